/*
 * trainer.h: what moe_trainer's main.c, route.c and save.c share: the options, a rank's
 * state (Trainer) and the error handling of its functions.
 */
#ifndef MOE_TRAINER_H
#define MOE_TRAINER_H

#include <moonshard.h>
#include <moonshard_embed.h>

#include "data.h"
#include "model.h"

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

// ----------------------------------------------------------------------------
// options

enum { MAX_SETS = 16 }; // --set options

typedef struct {
    int nranks;
    const char *mesh, *policy, *config, *data, *save;
    const char *recipe;   // --recipe FILE: NeMo Automodel's sections (docs/recipes.md); its peft adds LoRA
    int lora_grad_check;  // --lora-grad-check: the adapters' gradients checked, no training (-n 1)
    long steps;
    unsigned long long seed; // --seed (default DEFAULT_SEED)
    double eps, max_norm; // AdamW's eps and the gradient norm clipped at (0: no clipping)
    double lr, min_lr;    // --lr, --min-lr: the schedule's peak and floor (lr_at)
    long warmup;          // --warmup-steps
    long eval_every;      // --eval-every K (0: no eval, the whole text trains)
    int eval_batches;     // --eval-batches N: global batches of held-out text an eval averages
    int records, memory;
    char *save_path;  // --save, its symbolic links resolved (save_check)
    char *save_dir;   // the directory it is in, where the new file is made
    mode_t save_mode; // the new file's: an existing FILE's, else 0666 less the umask
    char *save_tmp;   // FILE.XXXXXX once rank 0 wrote it (RankArgs.save_tmp); save_end renames it
    const char *ckpt_dir;  // --save-dir DIR: moonshard checkpoints of the units (save.c)
    long ckpt_every;       // --save-every K (0: after the last step only)
    int keep_last;         // --keep-last N (0: keep every checkpoint)
    const char *resume;    // --resume DIR: a checkpoint, or a DIR whose latest names one
    const char *init_from; // --init-from PATH: a Hugging Face checkpoint loaded before step 1
    // from --mesh and --config
    int dp;         // data-parallel size: dp_replicate * dp_shard = RANKS / (pp * tp)
    int ep;         // expert-parallel size: experts split over groups of ep ranks
    int pp;         // pipeline stages, one a rank: rank r is stage r / dp, dp index r % dp (tp = 1)
    int microbatches;     // --microbatches M (pp > 1; default pp): micro-batches a step
    const char *schedule; // --schedule NAME (pp > 1), the policy's pipeline.schedule when NULL
    const char *sets[MAX_SETS]; // --set NAME=VALUE: the policy's options, in order
    int nsets;
    int tp;         // tensor-parallel size: groups of tp consecutive ranks share their rows (tp.c; pp = 1)
    int sp;         // --sequence-parallel
    int batch_size; // B, global rows per step
    ModelConfig model;
} Options;

// ----------------------------------------------------------------------------
// one rank

typedef struct {
    // shared, read-only
    const Options *opt;
    const Dataset *data;          // the text trained on (with --eval-every, all but the held-out tail)
    const Dataset *eval_data;     // --eval-every: the held-out tail, never trained on; else NULL
    ms_world *world;
    int rank;
    // results
    ms_status status;
    char err[2048];
    int64_t bytes[3], books[3], planned[3]; // --memory: params, grads, optimizer: allocated (counted at
                                            // the allocator), in the units' books, and planned
    char *save_tmp;               // --save, rank 0: the FILE.XXXXXX it wrote, for main to rename
} RankArgs;

// One layer's routed experts under expert parallelism, kept from forward to backward.  The
// pairs (position, slot) of this rank go to the ranks of its ep group that hold their
// experts, in chunks of `cap` rows (the largest count any rank sends any peer).
typedef struct {
    int cap;                  // rows a chunk holds in this layer's exchanges
    int *send_count;          // (ep) pairs sent to each peer
    int *recv_count;          // (ep) rows received from each peer
    int *order;               // (BT*K) this rank's pairs, grouped by destination
    int nrecv;                // rows received in all, computed here
    int *ids;                 // (nrecv) local expert of each received row
    float *x, *gu, *act;      // (nrecv, H), (nrecv, 2I), (nrecv, I): inputs and saved activations
} EpLayer;

typedef struct {
    const Options *opt;
    const ModelConfig *cfg;       // opt->model, or lora_cfg with --recipe
    ModelConfig lora_cfg;         // opt->model with the recipe's adapters (lora)
    ModelLora lora;               // the rank and alpha / rank of each Linear module's adapter
    RankArgs *args;
    ms_comm *world;
    ms_interp *in;
    int nunits, nparams, nstages; // stages: 0 embed, 1..L the layers, L+1 the head
    int prefetch_fwd, prefetch_bwd; // stages gathered ahead, as the policy prefetches units
    ModelParam *table;            // (nparams) model.h's parameter table
    ms_unit **units;              // (nunits) borrowed from the interpreter
    int *unit_of, *index_of;      // (nparams) the unit holding parameter i and its index there
    int *stage_of;                // (nparams) the stage that reads parameter i
    int *first_stage, *last_stage;// (nunits) the stages reading a unit's parameters, -1 when none
    int *gathered;                // (nunits) 1 from unshard until reshard or reduce_grads
    float *params;                // (P) f32 copies of the gathered parameters, laid out as table
    float *grads;                 // (P) f32 gradients of this rank's rows
    float **param_ptrs, **grad_ptrs; // (nparams) into params and grads
    int rows;                     // B / dp rows of the global batch on this rank
    int *tokens;                  // (rows, T+1)
    void *ws;                     // model_workspace_size(cfg, rows) bytes
    // expert parallelism: this rank holds experts [ep_base, ep_base + ep_local) of each layer
    int ep, ep_local, ep_base;
    ms_comm *ep_group;            // this rank's ep group, tag 1: apart from the units' groups
    EpLayer *ep_layers;           // (L)
    float *ep_send, *ep_recv;     // exchange buffers, ep_cap floats each
    size_t ep_cap;
    // pipeline (pp > 1, pipeline.c): this rank runs model stages [stage_lo, stage_hi]
    struct Pipeline *pipe;
    // tensor parallelism (tp.c): this rank is tp_rank of the tp group of ranks
    // [rank - tp_rank, rank - tp_rank + tp), the data-parallel rank rank / tp
    int tp, tp_rank;
    ms_comm *tp_group;            // tag 2: apart from the units' groups
    ModelTp mtp;                  // the model's hooks onto tp_group
    ms_status tp_status;          // of the latest collective on tp_group
    double lr, grad_norm;         // the latest step's learning rate and global gradient norm (before clipping)
    char resume_note[1024];       // --resume: the banner's line (checkpoint_resume)
    char resume_schedule[512];    // --resume: a note when this run's lr schedule is not the saved one's
    long done;                    // the steps done before this run (--resume's checkpoint's step)
    char resume_data[2560];       // --resume: a note when this run draws other batches (data, batch_size)
} Trainer;

// Records a failure in the rank's message ("WHAT: DETAIL") and returns st (main.c).
ms_status fail(Trainer *tr, ms_status st, const char *what, const char *fmt, ...);
// Seconds of the monotonic clock (timing only).
double now_seconds(void);

// A moonshard call that must succeed; its message explains a failure.
#define TRY(what, call)                                                                     \
    do {                                                                                    \
        ms_status st_ = (call);                                                             \
        if (st_) return fail(tr, st_, what, "%s", ms_last_error());                         \
    } while (0)
// A call of the trainer's own that already recorded its failure.
#define CHECK(call)                                                                         \
    do {                                                                                    \
        ms_status st_ = (call);                                                             \
        if (st_) return st_;                                                                \
    } while (0)
// A tensor getter of the unit API: NULL means failure (ms_last_error says why).
#define GET(var, what, call)                                                                \
    do {                                                                                    \
        if (!((var) = (call))) return fail(tr, MS_ERR_STATE, what, "%s", ms_last_error());  \
    } while (0)

// Used by pipeline.c, from main.c: a stage's units unsharded (started), then waited for and
// cast to f32; a unit's gradients handed to it and reduced; a layer forward and backward
// (through route.c under expert parallelism); a scalar all_reduce over the world; the
// clipped AdamW update of every unit of the rank.
ms_status unshard_stage(Trainer *tr, int s);
ms_status gather_stage(Trainer *tr, int s);
ms_status reduce_unit(Trainer *tr, int u);
ms_status forward_layer(Trainer *tr, int l);
ms_status backward_layer(Trainer *tr, int l);
ms_status all_reduce_one(Trainer *tr, double *v, ms_op op);
ms_status update(Trainer *tr, long step);

// pipeline.c (pp > 1; README.md, "Pipelines"): after materialize, the rank's stage, its pp
// group and its micro-batch workspaces; then one training step; then the frees.
ms_status pipeline_setup(Trainer *tr);
ms_status pipeline_step(Trainer *tr, long step, double *loss);
// The loss of one global batch of d (rows drawn for (seed, step)), forward only, through the
// stages as GPipe's forwards; the mean over the rows, on every rank.  The stage's units stay
// gathered (the caller releases them).
ms_status pipeline_eval_batch(Trainer *tr, const Dataset *d, uint64_t seed, int64_t step, double *loss);
void pipeline_free(Trainer *tr);

// The part of parameter i this rank's units hold: the whole tensor, or under expert
// parallelism the experts [ep_base, ep_base + ep_local) of an expert tensor.  Returns the
// offset in floats; *numel and shape (the part's) are filled. (main.c)
size_t param_part(const Trainer *tr, int i, size_t *numel, int64_t shape[3]);

#endif
