/*
 * tp.c: moe_trainer's tensor parallelism (tp > 1 in --mesh, README.md "Tensor
 * parallelism").  The planner's root mesh puts tp innermost: ranks [g tp, (g+1) tp) form a
 * tp group and are data-parallel rank g.  The policy applies tp_plans.inkling2 before
 * fully_shard, so each unit holds this rank's tp piece of the split tensors (the shared
 * experts' projections and lm_head) and shards it over dp_shard; the model's kernels
 * (model.h, "tensor parallelism") compute with the pieces and call back here for the
 * collectives on the tp group.
 */
#include "tp.h"

#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------
// the collectives the model calls (ModelTp), f32 on the tp group

static int wrap(ms_tensor **t, float *data, size_t n) {
    int64_t len = (int64_t)n;
    return ms_tensor_wrap(t, data, 1, &len, MS_F32) ? -1 : 0;
}

static int tp_all_reduce(void *host, float *x, size_t n) {
    Trainer *tr = host;
    ms_tensor *t = NULL;
    tr->tp_status = MS_ERR_OOM;
    if (wrap(&t, x, n)) return -1;
    tr->tp_status = ms_all_reduce(tr->tp_group, t, MS_OP_SUM);
    ms_tensor_release(t);
    return tr->tp_status ? -1 : 0;
}

// all_gather (out: tp pieces of n) or reduce_scatter (in: tp pieces of n) on the tp group.
static int gather_or_scatter(Trainer *tr, float *out, const float *in, size_t n, int gather) {
    ms_tensor *o = NULL, *i = NULL;
    const size_t nout = gather ? n * (size_t)tr->tp : n, nin = gather ? n : n * (size_t)tr->tp;
    tr->tp_status = MS_ERR_OOM;
    if (!wrap(&o, out, nout) && !wrap(&i, (float *)in, nin))
        tr->tp_status = gather ? ms_all_gather(tr->tp_group, o, i) : ms_reduce_scatter(tr->tp_group, o, i, MS_OP_SUM);
    ms_tensor_release(o);
    ms_tensor_release(i);
    return tr->tp_status ? -1 : 0;
}

static int tp_all_gather(void *host, float *out, const float *in, size_t n) {
    return gather_or_scatter(host, out, in, n, 1);
}

static int tp_reduce_scatter(void *host, float *out, const float *in, size_t n) {
    return gather_or_scatter(host, out, in, n, 0);
}

ms_status tp_setup(Trainer *tr) {
    const int tp = tr->opt->tp, rank = tr->args->rank;
    tr->tp = tp;
    tr->tp_rank = rank % tp;
    tr->mtp = (ModelTp){.size = tp, .rank = rank % tp, .sp = tr->opt->sp, .host = tr,
                        .all_reduce = tp_all_reduce, .all_gather = tp_all_gather,
                        .reduce_scatter = tp_reduce_scatter};
    if (tp == 1) return MS_OK;
    int members[64];
    for (int j = 0; j < tp; j++) members[j] = rank - tr->tp_rank + j;
    TRY("making the tp group", ms_comm_group_tagged(tr->world, tp, members, 2, &tr->tp_group));
    return MS_OK;
}

// ----------------------------------------------------------------------------
// which tensors are split, and their pieces

int tp_split_dim(const Trainer *tr, int i) {
    const ModelConfig *cfg = tr->cfg;
    if (tr->tp <= 1) return -1;
    if (i == model_lm_head(cfg)) return 0; // colwise: (V, H) split on V
    if (i < 1 || i >= model_final_norm(cfg)) return -1;
    switch ((i - 1) % LP_COUNT) {
    case LP_SHARED_GATE: case LP_SHARED_UP: return 0; // colwise: (Is, H) split on Is
    case LP_SHARED_DOWN: return 1;                    // rowwise: (H, Is) split on Is
    default: return -1;
    }
}

void tp_piece_shape(const Trainer *tr, int i, size_t *numel, int64_t shape[3]) {
    const ModelParam *p = &tr->table[i];
    const int d = tp_split_dim(tr, i);
    for (int k = 0; k < 3; k++) shape[k] = p->shape[k];
    if (d >= 0) shape[d] /= tr->tp;
    *numel = (size_t)shape[0] * (size_t)(shape[1] ? shape[1] : 1) * (size_t)(shape[2] ? shape[2] : 1);
}

// Copies between the full 2-D tensor (rows, cols) and this rank's piece: rows
// [t rows/tp, ...) for dim 0, columns [t cols/tp, ...) for dim 1.
static void piece_copy(const Trainer *tr, int i, float *full, float *piece, int to_piece) {
    const ModelParam *p = &tr->table[i];
    const int d = tp_split_dim(tr, i);
    const size_t rows = (size_t)p->shape[0], cols = (size_t)p->shape[1];
    if (d < 0) {
        if (to_piece) memcpy(piece, full, p->numel * sizeof(float));
        else memcpy(full, piece, p->numel * sizeof(float));
        return;
    }
    const size_t r0 = d == 0 ? rows / tr->tp * tr->tp_rank : 0, nr = d == 0 ? rows / tr->tp : rows;
    const size_t c0 = d == 1 ? cols / tr->tp * tr->tp_rank : 0, nc = d == 1 ? cols / tr->tp : cols;
    for (size_t r = 0; r < nr; r++) {
        float *f = full + (r0 + r) * cols + c0, *q = piece + r * nc;
        if (to_piece) memcpy(q, f, nc * sizeof(float));
        else memcpy(f, q, nc * sizeof(float));
    }
}

void tp_take_piece(const Trainer *tr, int i, const float *full, float *piece) {
    piece_copy(tr, i, (float *)full, piece, 1);
}

void tp_put_piece(const Trainer *tr, int i, const float *piece, float *full) {
    piece_copy(tr, i, full, (float *)piece, 0);
}

// ----------------------------------------------------------------------------
// the stages

static ms_status collective_failed(Trainer *tr, const char *what) {
    return fail(tr, tr->tp_status, what, "a collective on the tp group failed: %s", ms_last_error());
}

ms_status tp_forward_layer(Trainer *tr, int l) {
    if (model_tp_forward_layer(tr->cfg, l, tr->param_ptrs, tr->ws, &tr->mtp)) return collective_failed(tr, "forward");
    return MS_OK;
}

ms_status tp_backward_layer(Trainer *tr, int l) {
    if (model_tp_backward_layer(tr->cfg, l, tr->param_ptrs, tr->grad_ptrs, tr->ws, &tr->mtp))
        return collective_failed(tr, "backward");
    return MS_OK;
}

ms_status tp_forward_head(Trainer *tr, float *loss) {
    if (model_tp_forward_head(tr->cfg, tr->param_ptrs, tr->ws, &tr->mtp, loss)) return collective_failed(tr, "forward");
    return MS_OK;
}

ms_status tp_backward_head(Trainer *tr) {
    if (model_tp_backward_head(tr->cfg, tr->param_ptrs, tr->grad_ptrs, tr->ws, &tr->mtp))
        return collective_failed(tr, "backward");
    return MS_OK;
}

ms_status tp_reduce_stage_grads(Trainer *tr, int s) {
    if (tr->tp == 1 || !tr->opt->sp) return MS_OK;
    for (int i = 0; i < tr->nparams; i++) {
        if (tr->stage_of[i] != s || !tr->table[i].requires_grad || tp_split_dim(tr, i) >= 0) continue;
        if (tp_all_reduce(tr, tr->grad_ptrs[i], tr->table[i].numel))
            return collective_failed(tr, "all-reducing the sequence-parallel gradients");
    }
    return MS_OK;
}

// ms_unit_grad_sq_norm counts a unit's elements once over its shard and replicate groups;
// over tp a replicated parameter is held tp times, so its share of the unit's norm is
// weighted 1/tp: the unit's norm times (sum of w_i |g_i|^2) / (sum of |g_i|^2) over its
// parameters, w_i = 1 for a tp piece and 1/tp for a replicated one.
ms_status tp_grad_sq_norm(Trainer *tr, double *sq) {
    *sq = 0.0;
    for (int u = 0; u < tr->nunits; u++) {
        double norm, all = 0.0, weighted = 0.0;
        TRY("gradient norm", ms_unit_grad_sq_norm(tr->units[u], &norm));
        for (int i = 0; i < tr->nparams; i++) {
            if (tr->unit_of[i] != u || !tr->table[i].requires_grad) continue;
            ms_tensor *g, *v = NULL;
            GET(g, "gradient norm", ms_unit_grad_shard(tr->units[u], tr->index_of[i]));
            TRY("gradient norm", ms_tensor_to(&v, g, MS_F32));
            const float *x = ms_tensor_data(v);
            double s = 0.0;
            for (int64_t k = 0; k < ms_tensor_numel(v); k++) s += (double)x[k] * x[k];
            ms_tensor_release(v);
            all += s;
            weighted += tp_split_dim(tr, i) >= 0 ? s : s / tr->tp;
        }
        if (all > 0.0) *sq += norm * (weighted / all);
    }
    return MS_OK;
}
