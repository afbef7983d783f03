/*
 * route.c: moe_trainer's expert parallelism (ep > 1): a layer's routed experts, each pair's
 * token sent to the rank holding its expert and the result brought back with all_to_all on
 * the ep group (README.md, "Expert parallelism").
 */
#include "route.h"

#include <stdlib.h>
#include <string.h>

// At least n floats in each exchange buffer.
static ms_status ep_reserve(Trainer *tr, size_t n) {
    if (n <= tr->ep_cap) return MS_OK;
    float *a = realloc(tr->ep_send, n * sizeof(float)), *b = a ? realloc(tr->ep_recv, n * sizeof(float)) : NULL;
    if (a) tr->ep_send = a;
    if (b) tr->ep_recv = b;
    if (!a || !b) return fail(tr, MS_ERR_OOM, "expert parallelism", "out of memory for %zu floats", n);
    tr->ep_cap = n;
    return MS_OK;
}

// all_to_all on the ep group of chunks of `cap` rows of `width` floats (ep_send -> ep_recv).
static ms_status ep_exchange(Trainer *tr, int cap, int width) {
    int64_t n = (int64_t)tr->ep * cap * width;
    ms_tensor *in = NULL, *out = NULL;
    ms_status st = ms_tensor_wrap(&in, tr->ep_send, 1, &n, MS_F32);
    if (!st) st = ms_tensor_wrap(&out, tr->ep_recv, 1, &n, MS_F32);
    if (!st) st = ms_all_to_all(tr->ep_group, out, in);
    ms_tensor_release(in);
    ms_tensor_release(out);
    TRY("all_to_all on the ep group", st);
    return MS_OK;
}

// Routes layer l's pairs: who gets which, how many each peer sends here, the chunk size.
static ms_status ep_route(Trainer *tr, int l, EpLayer *el) {
    const int P = tr->rows * tr->cfg->seq_len * tr->cfg->top_k, ep = tr->ep;
    const int *choice = model_routing(tr->cfg, l, tr->ws);
    memset(el->send_count, 0, (size_t)ep * sizeof(int));
    for (int p = 0; p < P; p++) el->send_count[choice[p] / tr->ep_local]++;
    int *next = el->recv_count; // scratch: where each destination's pairs go in `order`
    for (int j = 0, at = 0; j < ep; at += el->send_count[j], j++) next[j] = at;
    for (int p = 0; p < P; p++) el->order[next[choice[p] / tr->ep_local]++] = p;
    // counts to every peer (one row of one float each), then the largest over the group
    CHECK(ep_reserve(tr, (size_t)ep));
    int most = 0;
    for (int j = 0; j < ep; j++) {
        tr->ep_send[j] = (float)el->send_count[j];
        if (el->send_count[j] > most) most = el->send_count[j];
    }
    CHECK(ep_exchange(tr, 1, 1));
    el->nrecv = 0;
    for (int j = 0; j < ep; j++) el->nrecv += el->recv_count[j] = (int)tr->ep_recv[j];
    double cap = most;
    ms_tensor *t = NULL;
    int64_t one = 1;
    TRY("wrapping a scalar", ms_tensor_wrap(&t, &cap, 1, &one, MS_F64));
    ms_status st = ms_all_reduce(tr->ep_group, t, MS_OP_MAX);
    ms_tensor_release(t);
    TRY("all_reduce on the ep group", st);
    el->cap = (int)cap;
    return MS_OK;
}

// Sends rows of `width` floats, one per pair of this rank (row(p) gives pair p's), to the
// experts' ranks: on return ep_recv holds chunk j from peer j.
typedef const float *(*pair_row_fn)(Trainer *tr, int l, int p);
static ms_status ep_send_pairs(Trainer *tr, int l, EpLayer *el, int width, pair_row_fn row, int with_id) {
    const int stride = width + with_id;
    CHECK(ep_reserve(tr, (size_t)tr->ep * el->cap * stride));
    const int *choice = model_routing(tr->cfg, l, tr->ws);
    for (int j = 0, at = 0; j < tr->ep; at += el->send_count[j], j++)
        for (int s = 0; s < el->send_count[j]; s++) {
            int p = el->order[at + s];
            float *dst = tr->ep_send + ((size_t)j * el->cap + s) * stride;
            memcpy(dst, row(tr, l, p), (size_t)width * sizeof(float));
            if (with_id) dst[width] = (float)(choice[p] - j * tr->ep_local); // the owner's local expert
        }
    return ep_exchange(tr, el->cap, stride);
}

// The reverse: rows (width floats) of the rows received, in the order received, go back to
// their senders; each arrives in out + p * width of its pair p.
static ms_status ep_return_rows(Trainer *tr, EpLayer *el, const float *rows, int width, float *out) {
    CHECK(ep_reserve(tr, (size_t)tr->ep * el->cap * width));
    for (int j = 0, r = 0; j < tr->ep; j++)
        for (int s = 0; s < el->recv_count[j]; s++, r++)
            memcpy(tr->ep_send + ((size_t)j * el->cap + s) * width, rows + (size_t)r * width,
                   (size_t)width * sizeof(float));
    CHECK(ep_exchange(tr, el->cap, width));
    for (int j = 0, at = 0; j < tr->ep; at += el->send_count[j], j++)
        for (int s = 0; s < el->send_count[j]; s++)
            memcpy(out + (size_t)el->order[at + s] * width, tr->ep_recv + ((size_t)j * el->cap + s) * width,
                   (size_t)width * sizeof(float));
    return MS_OK;
}

// The rows received (chunks of rows of `stride` floats) packed: their first `width` floats
// into rows, and with ids the float after them (the local expert) into ids.
static void ep_unpack(const Trainer *tr, const EpLayer *el, int stride, int width, float *rows, int *ids) {
    for (int j = 0, r = 0; j < tr->ep; j++)
        for (int s = 0; s < el->recv_count[j]; s++, r++) {
            const float *src = tr->ep_recv + ((size_t)j * el->cap + s) * stride;
            memcpy(rows + (size_t)r * width, src, (size_t)width * sizeof(float));
            if (ids) ids[r] = (int)src[width];
        }
}

// Grows a layer's per-row buffers to hold nrecv rows.
static ms_status ep_layer_reserve(Trainer *tr, EpLayer *el) {
    const size_t n = (size_t)(el->nrecv ? el->nrecv : 1), H = tr->cfg->hidden_size, I = tr->cfg->expert_dim;
    int *ids = realloc(el->ids, n * sizeof(int));
    if (ids) el->ids = ids;
    float **bufs[3] = {&el->x, &el->gu, &el->act};
    const size_t width[3] = {H, 2 * I, I};
    int ok = ids != NULL;
    for (int k = 0; ok && k < 3; k++) {
        float *b = realloc(*bufs[k], n * width[k] * sizeof(float));
        if (b) *bufs[k] = b;
        ok = b != NULL;
    }
    return ok ? MS_OK : fail(tr, MS_ERR_OOM, "expert parallelism", "out of memory for %d rows", el->nrecv);
}

static const float *pair_input(Trainer *tr, int l, int p) {
    return model_layer_moe_input(tr->cfg, l, tr->ws) + (size_t)(p / tr->cfg->top_k) * tr->cfg->hidden_size;
}
static const float *pair_dout(Trainer *tr, int l, int p) {
    (void)l;
    return model_layer_expert_dout(tr->cfg, tr->ws) + (size_t)p * tr->cfg->hidden_size;
}

// This rank's slice of an expert tensor of layer l (its experts, local index 0..ep_local).
static float *local_experts(const Trainer *tr, float *const *ptrs, int l, int k) {
    int i = model_layer_param(tr->cfg, l, k);
    size_t numel;
    int64_t shape[3];
    return ptrs[i] + param_part(tr, i, &numel, shape);
}

// Layer l's routed experts, forward: pairs out, experts run here on what arrives, back.
ms_status ep_forward(Trainer *tr, int l) {
    EpLayer *el = &tr->ep_layers[l];
    const int H = tr->cfg->hidden_size;
    CHECK(ep_route(tr, l, el));
    CHECK(ep_send_pairs(tr, l, el, H, pair_input, 1));
    CHECK(ep_layer_reserve(tr, el));
    ep_unpack(tr, el, H + 1, H, el->x, el->ids);
    float *out = malloc((size_t)(el->nrecv ? el->nrecv : 1) * H * sizeof(float));
    if (!out) return fail(tr, MS_ERR_OOM, "expert parallelism", "out of memory");
    model_experts_forward(tr->cfg, local_experts(tr, tr->param_ptrs, l, LP_EXPERTS_GATE_UP),
                          local_experts(tr, tr->param_ptrs, l, LP_EXPERTS_DOWN), el->ids, el->x, 1, el->nrecv,
                          out, el->gu, el->act);
    ms_status st = ep_return_rows(tr, el, out, H, model_layer_expert_out(tr->cfg, l, tr->ws));
    free(out);
    return st;
}

// Layer l's routed experts, backward: d output of each pair to the expert's rank, the
// expert gradients accumulated there, d input of each pair back.
ms_status ep_backward(Trainer *tr, int l) {
    EpLayer *el = &tr->ep_layers[l];
    const int H = tr->cfg->hidden_size;
    CHECK(ep_send_pairs(tr, l, el, H, pair_dout, 0));
    float *dout = malloc((size_t)(el->nrecv ? el->nrecv : 1) * 2 * H * sizeof(float));
    if (!dout) return fail(tr, MS_ERR_OOM, "expert parallelism", "out of memory");
    float *dx = dout + (size_t)(el->nrecv ? el->nrecv : 1) * H;
    ep_unpack(tr, el, H, H, dout, NULL);
    model_experts_backward(tr->cfg, local_experts(tr, tr->param_ptrs, l, LP_EXPERTS_GATE_UP),
                           local_experts(tr, tr->param_ptrs, l, LP_EXPERTS_DOWN), el->ids, el->x, 1, el->nrecv,
                           el->gu, el->act, dout, dx, local_experts(tr, tr->grad_ptrs, l, LP_EXPERTS_GATE_UP),
                           local_experts(tr, tr->grad_ptrs, l, LP_EXPERTS_DOWN), tr->ws);
    ms_status st = ep_return_rows(tr, el, dx, H, model_layer_expert_dh(tr->cfg, tr->ws));
    free(dout);
    return st;
}
