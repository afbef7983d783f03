/*
 * save.h: moe_trainer's --save (save.c); main.c checks FILE before the ranks start
 * (save_check) and completes it after the run (save_end).
 */
#ifndef MOE_SAVE_H
#define MOE_SAVE_H

#include "trainer.h"

// The f32 master shards (not the bf16 a unit may gather in) assembled on every rank: each
// rank writes the elements it holds into a -inf buffer and an all_reduce max over the world
// fills it (ranks holding the same element hold the same value).  A shard is the rows
// [offset, offset + rows) of its shard dim (ms_unit_param_offset) of the part of the
// parameter the rank's unit holds (param_part: the whole tensor, or its local experts).
ms_status save(Trainer *tr);

// --save-dir: a checkpoint of the units after step `step` (collective), its extra the
// trainer's state (the data position, the seed, the lr schedule, the model sizes).
ms_status checkpoint_save(Trainer *tr, long step);
// --resume: the checkpoint checked against this run and loaded; *done its step.
ms_status checkpoint_resume(Trainer *tr, long *done);

// The checkpoints (step_K directories) in dir with K > after: their count, the first's and
// the last's names in first and last (len bytes each).  0 when dir cannot be read.
int checkpoint_dir_steps(const char *dir, long after, char *first, char *last, size_t len);
// --save-dir with --resume at step `done`: refused when the directory holds checkpoints past
// it (of another run, or of this one beyond its resumed step: the saves would collide).
ms_status checkpoint_dir_check(Trainer *tr, long done);

#endif
