/*
 * pipeline.c: moe_trainer's pipeline parallelism (--mesh pp=P,...): each rank runs one
 * stage of the model (Automodel's split, as the plan made it: stage 0 the embedding and its
 * layers, the last stage its layers and the head), the micro-batches of its data-parallel
 * rows in the schedule's order, the activations sent to the next stage and their gradients
 * back with point-to-point batches on a pp group.  README.md, "Pipelines", says what and why.
 *
 * Ranks: pp is the outermost mesh axis, so rank r is stage r / dp at data-parallel index
 * r % dp, and the pp group of a dp index is the ranks {d, dp + d, 2 dp + d, ...}: group rank
 * = stage.  The group is tagged (PP_GROUP_TAG) so that its sends never pair with the units'
 * collectives, which run on the communication thread meanwhile.
 *
 * Schedules (PyTorch's torch.distributed.pipelining, one stage a rank):
 *   GPipe: every micro-batch forward, then every one backward; M workspaces.
 *   1F1B:  stage s runs w = min(M, P - s) forwards (warm-up), then alternates one backward
 *          and one forward, then the remaining backwards (cool-down); w workspaces, the
 *          forward of micro-batch i reusing the one of micro-batch i - w, whose backward is
 *          done.  The sends and receives are grouped as PyTorch's Schedule1F1B groups them
 *          (the last warm-up forward's send with the first backward's receive; each
 *          backward's send with the next forward's receive), so that the k-th batch a rank
 *          posts towards a neighbour pairs with the k-th batch the neighbour posts back:
 *          moonshard's p2p batches match that way (moonshard.h, ms_batch_p2p).
 *
 * FSDP under the pipeline (Automodel: reshard_after_forward false): the rank's units are
 * unsharded once a step before the first micro-batch and stay so; gradients accumulate in
 * f32 over the micro-batches (each the gradient of its own mean loss, so they are scaled by
 * 1/M at the end: the gradient of the mean over the rank's rows), and every unit reduces
 * once after the last backward.  The loss is the mean over micro-batches and dp ranks,
 * computed on the last stage and summed over the world (the other stages add 0).
 */
#include "trainer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    PP_GROUP_TAG = 2, // ep groups are tag 1 (main.c)
    TAG_ACTIVATION = 0,
    TAG_GRADIENT = 1,
    MAX_OPS = 2, // a batch names one neighbour: a send and a receive at most
};

typedef enum { SCHEDULE_GPIPE, SCHEDULE_1F1B } Schedule;

struct Pipeline {
    Schedule schedule;
    const char *schedule_name;
    int stages, stage;     // P, this rank's stage (its pp coordinate)
    int dp_index;          // rank % dp: its rows of the global batch
    int lo, hi;            // model stages run here: 0 embed, 1..L layers, L+1 head
    int first_layer, end_layer; // layers [first_layer, end_layer)
    int micro, rows;       // M micro-batches of `rows` rows a step
    ms_comm *group;        // the pp group of this dp index, tagged
    int nws;               // workspaces: the micro-batches in flight at the peak
    void **ws;             // (nws) model_workspace_size(cfg, rows) bytes each
    void *home_ws;         // the trainer's own workspace, tr->ws again at the end
    double loss_sum;       // the step's micro-batch losses (last stage)
};

// A batch of point-to-point ops towards one neighbour, built up then posted.
typedef struct {
    ms_p2p_op op[MAX_OPS];
    int n;
} Batch;

// ----------------------------------------------------------------------------
// setup

// In the plan JSON's "pipeline" object (docs/planning.md): where the value of `key` starts
// after its opening character `open` ('"' a string, '[' an array), or NULL.
static const char *pipeline_value(const char *json, const char *key, char open) {
    const char *p = strstr(json, "\"pipeline\":");
    char k[48];
    snprintf(k, sizeof k, "\"%s\":%c", key, open);
    if (p) p = strstr(p, k);
    return p ? p + strlen(k) : NULL;
}

// The string value of `key` copied into out; -1 when absent or too long.
static int plan_string(const char *json, const char *key, char *out, size_t len) {
    const char *p = pipeline_value(json, key, '"');
    size_t n = p ? strcspn(p, "\"") : len;
    if (n >= len) return -1;
    memcpy(out, p, n);
    out[n] = '\0';
    return 0;
}

// The (index)-th integer of the array `key`; -1 when absent.
static long plan_array_item(const char *json, const char *key, int index) {
    const char *p = pipeline_value(json, key, '[');
    for (int i = 0; i < index && p; i++) p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL;
    return p ? strtol(p, NULL, 10) : -1;
}

// The model stages whose parameters this rank's units hold: [lo, hi], contiguous, the
// embedding only on stage 0 and the head only on the last.
static ms_status find_stages(Trainer *tr, struct Pipeline *pl) {
    const int L = tr->cfg->num_layers;
    pl->lo = tr->nstages, pl->hi = -1;
    for (int i = 0; i < tr->nparams; i++) {
        if (tr->unit_of[i] < 0) continue;
        if (tr->stage_of[i] < pl->lo) pl->lo = tr->stage_of[i];
        if (tr->stage_of[i] > pl->hi) pl->hi = tr->stage_of[i];
    }
    for (int i = 0; i < tr->nparams; i++) {
        const int s = tr->stage_of[i], held = tr->unit_of[i] >= 0;
        if (held != (s >= pl->lo && s <= pl->hi))
            return fail(tr, MS_ERR_INTERNAL, "pipeline", "stage %d holds model stages %d..%d but %s %s", pl->stage,
                        pl->lo, pl->hi, tr->table[i].name, held ? "is held here too" : "is not");
    }
    if (pl->hi < pl->lo || (pl->lo == 0) != (pl->stage == 0) || (pl->hi == L + 1) != (pl->stage == pl->stages - 1))
        return fail(tr, MS_ERR_INTERNAL, "pipeline", "stage %d of %d holds model stages %d..%d (0 the embedding, %d "
                    "the head)", pl->stage, pl->stages, pl->lo, pl->hi, L + 1);
    pl->first_layer = pl->lo == 0 ? 0 : pl->lo - 1;
    pl->end_layer = pl->hi == L + 1 ? L : pl->hi;
    return MS_OK;
}

ms_status pipeline_setup(Trainer *tr) {
    const Options *opt = tr->opt;
    struct Pipeline *pl = tr->pipe = calloc(1, sizeof *tr->pipe);
    if (!pl) return fail(tr, MS_ERR_OOM, "allocating", "out of memory");
    pl->stages = opt->pp;
    pl->stage = tr->args->rank / opt->dp;
    pl->dp_index = tr->args->rank % opt->dp;
    pl->micro = opt->microbatches;
    pl->rows = tr->rows / pl->micro;
    pl->home_ws = tr->ws; // tr->ws points at the micro-batch's while its stage runs
    CHECK(find_stages(tr, pl));

    char *json = NULL, name[32];
    TRY("reading the plan JSON", ms_interp_plan_json(tr->in, &json));
    const int missing = plan_string(json, "schedule", name, sizeof name);
    const long planned_flight = plan_array_item(json, "in_flight", pl->stage);
    free(json);
    if (missing) return fail(tr, MS_ERR_INTERNAL, "pipeline", "the plan names no pipeline schedule");
    if (!strcmp(name, "GPipe")) {
        pl->schedule = SCHEDULE_GPIPE, pl->schedule_name = "GPipe";
        pl->nws = pl->micro;
    } else if (!strcmp(name, "1F1B")) {
        pl->schedule = SCHEDULE_1F1B, pl->schedule_name = "1F1B";
        pl->nws = pl->micro < pl->stages - pl->stage ? pl->micro : pl->stages - pl->stage;
    } else {
        return fail(tr, MS_ERR_ARG, "pipeline", "the plan's schedule is %s; moe_trainer runs GPipe and 1F1B (one "
                    "stage a rank)", name);
    }
    if (planned_flight != pl->nws)
        return fail(tr, MS_ERR_INTERNAL, "pipeline", "%s keeps %d micro-batches in flight on stage %d, the plan says "
                    "%ld", pl->schedule_name, pl->nws, pl->stage, planned_flight);

    int members[64];
    for (int p = 0; p < pl->stages; p++) members[p] = p * opt->dp + pl->dp_index;
    TRY("making the pp group", ms_comm_group_tagged(tr->world, pl->stages, members, PP_GROUP_TAG, &pl->group));
    pl->ws = calloc((size_t)pl->nws, sizeof *pl->ws);
    if (!pl->ws) return fail(tr, MS_ERR_OOM, "allocating", "out of memory");
    for (int k = 0; k < pl->nws; k++)
        if (!(pl->ws[k] = malloc(model_workspace_size(tr->cfg, pl->rows))))
            return fail(tr, MS_ERR_OOM, "allocating", "out of memory for %d micro-batch workspaces", pl->nws);
    return MS_OK;
}

void pipeline_free(Trainer *tr) {
    struct Pipeline *pl = tr->pipe;
    if (!pl) return;
    tr->ws = pl->home_ws;
    for (int k = 0; pl->ws && k < pl->nws; k++) free(pl->ws[k]);
    free(pl->ws);
    ms_comm_release(pl->group);
    free(pl);
    tr->pipe = NULL;
}

// ----------------------------------------------------------------------------
// sends and receives

// Adds to b a send or receive of micro-batch activations (rows, T, H) f32 at data.
static ms_status add_op(Trainer *tr, Batch *b, ms_p2p_kind kind, float *data, int peer, int tag) {
    const int64_t shape[3] = {tr->pipe->rows, tr->cfg->seq_len, tr->cfg->hidden_size};
    ms_tensor *t = NULL;
    TRY("wrapping an activation", ms_tensor_wrap(&t, data, 3, shape, MS_F32));
    b->op[b->n++] = (ms_p2p_op){kind, t, peer, tag};
    return MS_OK;
}

// Posts b (nothing when empty) and waits for it; b is empty afterwards.
static ms_status post(Trainer *tr, Batch *b) {
    const struct Pipeline *pl = tr->pipe;
    ms_status st = b->n ? ms_batch_p2p(pl->group, b->op, b->n) : MS_OK;
    if (st) {
        const int peer = b->op[0].peer;
        fail(tr, st, "pipeline", "stage %d (rank %d) with stage %d (rank %d): %s", pl->stage, tr->args->rank, peer,
             peer * tr->opt->dp + pl->dp_index, ms_last_error());
    }
    for (int k = 0; k < b->n; k++) ms_tensor_release(b->op[k].t);
    b->n = 0;
    return st;
}

static void *ws_of(const Trainer *tr, int i) { return tr->pipe->ws[i % tr->pipe->nws]; }

// The ops of micro-batch i with the previous stage (the activation received, its gradient
// sent) and with the next (the activation sent, its gradient received); none at the ends.
static ms_status recv_activation(Trainer *tr, Batch *b, int i) {
    const struct Pipeline *pl = tr->pipe;
    if (pl->stage == 0) return MS_OK;
    return add_op(tr, b, MS_P2P_RECV, model_layer_input(tr->cfg, pl->first_layer, ws_of(tr, i)), pl->stage - 1,
                  TAG_ACTIVATION);
}

static ms_status send_activation(Trainer *tr, Batch *b, int i) {
    const struct Pipeline *pl = tr->pipe;
    if (pl->stage == pl->stages - 1) return MS_OK;
    return add_op(tr, b, MS_P2P_SEND, model_layer_input(tr->cfg, pl->end_layer, ws_of(tr, i)), pl->stage + 1,
                  TAG_ACTIVATION);
}

static ms_status recv_gradient(Trainer *tr, Batch *b, int i) {
    const struct Pipeline *pl = tr->pipe;
    if (pl->stage == pl->stages - 1) return MS_OK;
    return add_op(tr, b, MS_P2P_RECV, model_resid_grad(tr->cfg, ws_of(tr, i)), pl->stage + 1, TAG_GRADIENT);
}

static ms_status send_gradient(Trainer *tr, Batch *b, int i) {
    const struct Pipeline *pl = tr->pipe;
    if (pl->stage == 0) return MS_OK;
    return add_op(tr, b, MS_P2P_SEND, model_resid_grad(tr->cfg, ws_of(tr, i)), pl->stage - 1, TAG_GRADIENT);
}

// ----------------------------------------------------------------------------
// one micro-batch through this stage

// Micro-batch i's workspace takes its rows (the batch size and the tokens, which the head
// needs for its targets), before its activation is received into it.
static ms_status prepare(Trainer *tr, int i) {
    const struct Pipeline *pl = tr->pipe;
    const int *tokens = tr->tokens + (size_t)i * pl->rows * (tr->cfg->seq_len + 1);
    if (model_set_batch(tr->cfg, tokens, pl->rows, ws_of(tr, i)))
        return fail(tr, MS_ERR_ARG, "forward", "a byte of the text is outside the vocabulary");
    return MS_OK;
}

static ms_status forward_micro(Trainer *tr, int i) {
    struct Pipeline *pl = tr->pipe;
    tr->ws = ws_of(tr, i); // what forward_layer runs on
    if (pl->lo == 0) {
        const int *tokens = tr->tokens + (size_t)i * pl->rows * (tr->cfg->seq_len + 1);
        model_forward_embed(tr->cfg, tr->param_ptrs, tokens, pl->rows, tr->ws); // checked by prepare
    }
    for (int l = pl->first_layer; l < pl->end_layer; l++) CHECK(forward_layer(tr, l));
    if (pl->hi == tr->cfg->num_layers + 1) pl->loss_sum += model_forward_head(tr->cfg, tr->param_ptrs, tr->ws);
    return MS_OK;
}

static ms_status backward_micro(Trainer *tr, int i) {
    const struct Pipeline *pl = tr->pipe;
    tr->ws = ws_of(tr, i);
    if (pl->hi == tr->cfg->num_layers + 1) model_backward_head(tr->cfg, tr->param_ptrs, tr->grad_ptrs, tr->ws);
    for (int l = pl->end_layer - 1; l >= pl->first_layer; l--) CHECK(backward_layer(tr, l));
    if (pl->lo == 0) model_backward_embed(tr->cfg, tr->grad_ptrs, tr->ws);
    return MS_OK;
}

// Forward of micro-batch i: its workspace prepared, the activation received (with what b
// holds already), the stage run.
static ms_status forward_with(Trainer *tr, Batch *b, int i) {
    CHECK(prepare(tr, i));
    CHECK(recv_activation(tr, b, i));
    CHECK(post(tr, b));
    return forward_micro(tr, i);
}

// Backward of micro-batch i: the gradient received (with what b holds already), the stage run.
static ms_status backward_with(Trainer *tr, Batch *b, int i) {
    CHECK(recv_gradient(tr, b, i));
    CHECK(post(tr, b));
    return backward_micro(tr, i);
}

// ----------------------------------------------------------------------------
// schedules

// Every micro-batch forward: GPipe's first half, and an eval's pass.
static ms_status run_forwards(Trainer *tr) {
    Batch b = {0};
    for (int i = 0; i < tr->pipe->micro; i++) {
        CHECK(forward_with(tr, &b, i));
        CHECK(send_activation(tr, &b, i));
        CHECK(post(tr, &b));
    }
    return MS_OK;
}

static ms_status run_gpipe(Trainer *tr) {
    const int M = tr->pipe->micro;
    Batch b = {0};
    CHECK(run_forwards(tr));
    for (int i = 0; i < M; i++) {
        CHECK(backward_with(tr, &b, i));
        CHECK(send_gradient(tr, &b, i));
        CHECK(post(tr, &b));
    }
    return MS_OK;
}

// PyTorch's Schedule1F1B order, its sends and receives grouped as it groups them.
static ms_status run_1f1b(Trainer *tr) {
    const int M = tr->pipe->micro, warmup = tr->pipe->nws;
    Batch b = {0};
    int fwd = 0, bwd = 0;
    for (; fwd < warmup; fwd++) {
        CHECK(forward_with(tr, &b, fwd));
        CHECK(send_activation(tr, &b, fwd));
        if (fwd < warmup - 1) CHECK(post(tr, &b)); // the last one goes with the first backward's receive
    }
    for (;;) {
        CHECK(backward_with(tr, &b, bwd)); // b: the last forward's send
        CHECK(send_gradient(tr, &b, bwd));
        bwd++;
        if (fwd == M) break;
        CHECK(forward_with(tr, &b, fwd)); // b: the last backward's send
        CHECK(send_activation(tr, &b, fwd));
        fwd++;
    }
    CHECK(post(tr, &b));
    for (; bwd < M; bwd++) {
        CHECK(backward_with(tr, &b, bwd));
        CHECK(send_gradient(tr, &b, bwd));
        CHECK(post(tr, &b));
    }
    return MS_OK;
}

// ----------------------------------------------------------------------------
// one step

// The rows of this dp index of d's global batch (seed, step), and the stage's units
// unsharded once for every micro-batch (reshard_after_forward false).
static ms_status begin_batch(Trainer *tr, const Dataset *d, uint64_t seed, int64_t step) {
    struct Pipeline *pl = tr->pipe;
    const int T = tr->cfg->seq_len;
    if (dataset_rows(d, seed, step, T, pl->dp_index * tr->rows, tr->rows, tr->tokens))
        return fail(tr, MS_ERR_ARG, "reading the batch", "the text is shorter than seq_len + 1 = %d bytes", T + 1);
    for (int s = pl->lo; s <= pl->hi; s++) CHECK(unshard_stage(tr, s));
    for (int s = pl->lo; s <= pl->hi; s++) CHECK(gather_stage(tr, s));
    pl->loss_sum = 0.0;
    return MS_OK;
}

// The mean loss of the global batch on every rank: the last stage's mean over its
// micro-batches and dp ranks, summed over the world (the other stages add 0).
static ms_status batch_loss(Trainer *tr, double *loss) {
    const struct Pipeline *pl = tr->pipe;
    *loss = pl->hi == tr->cfg->num_layers + 1 ? pl->loss_sum / pl->micro / tr->opt->dp : 0.0;
    return all_reduce_one(tr, loss, MS_OP_SUM);
}

ms_status pipeline_eval_batch(Trainer *tr, const Dataset *d, uint64_t seed, int64_t step, double *loss) {
    CHECK(begin_batch(tr, d, seed, step));
    CHECK(run_forwards(tr));
    return batch_loss(tr, loss);
}

ms_status pipeline_step(Trainer *tr, long step, double *loss) {
    struct Pipeline *pl = tr->pipe;
    const ModelConfig *cfg = tr->cfg;
    CHECK(begin_batch(tr, tr->args->data, tr->opt->seed, step));
    memset(tr->grads, 0, model_param_numel(cfg) * sizeof(float));
    CHECK(pl->schedule == SCHEDULE_GPIPE ? run_gpipe(tr) : run_1f1b(tr));
    // the sum of M micro-batch mean gradients, to the gradient of the mean over the rows
    const float scale = 1.0f / (float)pl->micro;
    for (size_t j = 0, P = model_param_numel(cfg); j < P; j++) tr->grads[j] *= scale;
    for (int u = 0; u < tr->nunits; u++)
        if (tr->first_stage[u] >= 0) CHECK(reduce_unit(tr, u));
    for (int u = 0; u < tr->nunits; u++) TRY("waiting for reduce_grads", ms_unit_wait(tr->units[u]));
    CHECK(batch_loss(tr, loss));
    return update(tr, step);
}
