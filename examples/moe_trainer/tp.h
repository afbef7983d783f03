/*
 * tp.h: moe_trainer's tensor parallelism (tp.c; README.md, "Tensor parallelism").
 */
#ifndef MOE_TP_H
#define MOE_TP_H

#include "trainer.h"

// The tp group and the model's hooks onto it (after materialise).
ms_status tp_setup(Trainer *tr);
// The dim tp splits parameter i on (0 or 1), or -1 when it is replicated over tp.
int tp_split_dim(const Trainer *tr, int i);
// This rank's piece of a split parameter i: its numel and shape; the kernels read it
// contiguous at offset 0 of the parameter's buffer.
void tp_piece_shape(const Trainer *tr, int i, size_t *numel, int64_t shape[3]);
// Copies this rank's piece of parameter i out of the full tensor, or into it.
void tp_take_piece(const Trainer *tr, int i, const float *full, float *piece);
void tp_put_piece(const Trainer *tr, int i, const float *piece, float *full);
// The stages under tensor parallelism (the model's collectives on the tp group).
ms_status tp_forward_layer(Trainer *tr, int l);
ms_status tp_backward_layer(Trainer *tr, int l);
ms_status tp_forward_head(Trainer *tr, float *loss);
ms_status tp_backward_head(Trainer *tr);
// After stage s's backward: under sequence parallel the gradients of its replicated
// parameters are partial sums over tp; all-reduced here, before the units reduce them.
ms_status tp_reduce_stage_grads(Trainer *tr, int s);
// The squared gradient norm of this rank's shards, a replicated parameter counted 1/tp on
// each tp rank (once over the group).
ms_status tp_grad_sq_norm(Trainer *tr, double *sq);

#endif
