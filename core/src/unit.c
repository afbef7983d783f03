/*
 * unit.c: shard units, one rank's FSDP2 runtime: the unit itself (its parameters and
 * states), unshard and reshard, its gradients and their reduction.  Its buffers are
 * unit_cache.c's, its optimizer unit_adamw.c's; unit_internal.h is what the three share.
 */
#include "unit_internal.h"
#include "cuda.h"
#include "unit_math.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * A unit holds the padded shards of its parameters in their stored dtype (the shard dim
 * has ceil(n/W) rows on every rank for dim 0, n/W for another dim; the padding is zero and
 * stays zero) and moves them with the collectives of comm.c, queued on the rank's
 * communication thread (comm_async.c) so that compute on the rank's thread overlaps them.
 *
 *   unshard  every padded shard is cast to the gather dtype into this rank's chunk of a flat
 *            (W, S) buffer, S = sum of padded shard numels; all_gather in place over the
 *            shard group (over the k-group from a k-way shard); ms_unit_wait copies each
 *            rank's block of each parameter out into the unsharded parameter (global shape).
 *   reshard  frees them (1), keeps them (0), or keeps this rank's segment of the (W, S)
 *            layout for a k-way regather (k), rebuilt from the unsharded parameters.
 *   reduce   each rank's block of every gradient is packed into a (W, S_r) buffer in the
 *            reduce dtype (S_r over the parameters that have a gradient this step; padding
 *            zero), pre-scaled, reduce_scatter in place, all_reduce over the replicate group
 *            (HSDP); ms_unit_wait post-divides, casts to the stored dtype and accumulates
 *            into the gradient shards.
 *   in place A unit of one parameter with nothing before its shard dim (a dim-0 shard, the
 *            common case of a unit per weight) has a (W, S) layout that is its full tensor
 *            as is, padding rows at the end: the unsharded parameter is a view of the gather
 *            buffer (no copy-out), and when the reduce dtype is the gather dtype the
 *            unsharded gradient is a view of the zeroed reduce_scatter input (no packing).
 *
 * Every buffer the unit allocates goes through buf_new / buf_free (unit_cache.c), which
 * keep the byte counts of ms_unit_bytes exact.  All unit state belongs to the rank's
 * thread; while an op is pending, the communication thread touches only that op's tensors
 * (unit_op).
 *
 * On a CUDA backend (nccl) every buffer lives on the rank's GPU: the shards, gradient
 * shards and optimizer state, the gather and reduce buffers, the unsharded parameters and
 * gradients, so the collectives move device memory and the element-wise steps (pre-scale,
 * sync-off accumulation, post-divide and accumulation into the gradient shards, norm,
 * clipping, AdamW) run as kernels (cuda.h) computing the host's bits (unit_math.h).  With
 * ms_unit_set_cpu_offload (FSDP2's CPUOffloadPolicy) the shards, gradient shards and
 * optimizer state stay on the host: unshard casts each shard into the device chunk
 * (ms_tensor_copy across devices), the reduced chunk comes back to the host before the
 * post-divide and the accumulation, and the optimizer runs on the host.
 */

/* ---------------------------------------------------------------- buffers and states */

static const char *const state_name[] = {
    [ST_BUILDING] = "building (not finalized)",
    [ST_SHARDED] = "sharded",
    [ST_GATHERING] = "unsharding (all_gather pending; call ms_unit_wait)",
    [ST_UNSHARDED] = "unsharded",
    [ST_KEPT] = "resharded with its unsharded parameters kept (ms_unit_unshard makes them current again)",
    [ST_KWAY] = "resharded to a k-way shard",
    [ST_REDUCING] = "reducing (reduce_grads pending; call ms_unit_wait)",
    [ST_FAILED] = "failed",
    [ST_ZERO] = "a Megatron-FSDP bucket (use the ms_unit_zero_* calls)",
};

static void view_free(ms_tensor **t) {
    ms_tensor_release(*t);
    *t = NULL;
}

/* Element i of a contiguous buffer (NULL stays NULL: empty tensors have no data). */
static void *at(ms_tensor *t, int64_t i) {
    char *d = ms_tensor_data(t);
    return d ? d + i * ms_dtype_size(ms_tensor_dtype(t)) : NULL;
}

ms_status check_state(const ms_unit *u, const char *call, unsigned allowed) {
    if (allowed & ST(u->state)) return MS_OK;
    if (u->state == ST_FAILED)
        return ms__fail(MS_ERR_STATE, "unit '%s': %s: the unit is unusable after a failed collective: %s", unit_label(u),
                        call, u->failure);
    return ms__fail(MS_ERR_STATE, "unit '%s': %s: not allowed while the unit is %s", unit_label(u), call,
                    state_name[u->state]);
}

ms_status param_at(const ms_unit *u, const char *call, int i, unit_param **out) {
    if (i < 0 || i >= u->nparams)
        return ms__fail(MS_ERR_ARG, "unit '%s': %s: no parameter %d (the unit has %d, numbered from 0)", unit_label(u),
                        call, i, u->nparams);
    *out = &u->params[i];
    return MS_OK;
}

/* Drops *t, an unsharded buffer of u or, when *flat is set, a view of *flat, dropped too. */
static void unsharded_free(ms_unit *u, ms_tensor **t, ms_tensor **flat) {
    if (*flat) {
        view_free(t);
        buf_free(u, MS_BYTES_UNSHARDED, flat);
    } else {
        buf_free(u, MS_BYTES_UNSHARDED, t);
    }
}

/* The unsharded parameters, their gradients of this backward and the k-way shard. */
static void free_unsharded(ms_unit *u) {
    for (int i = 0; i < u->nparams; i++) {
        unit_param *p = &u->params[i];
        unsharded_free(u, &p->full, &p->full_flat);
        unsharded_free(u, &p->grad_full, &p->grad_flat);
    }
    buf_free(u, MS_BYTES_UNSHARDED, &u->kept);
}

/* The pending op's buffers. */
static void op_clear(ms_unit *u) {
    view_free(&u->op.slice);
    buf_free(u, MS_BYTES_UNSHARDED, &u->flat);
    for (int g = 0; g < u->op.nred; g++) {
        view_free(&u->op.red[g].slice);
        buf_free(u, MS_BYTES_UNSHARDED, &u->op.red[g].flat);
    }
    u->op.nred = 0;
}

/* Marks u unusable after a failed or half-finished collective (its peers cannot be
 * matched any more): keeps st's message, prefixed with the unit and the call. */
static ms_status unit_fail(ms_unit *u, ms_status st, const char *call) {
    ms__wrap(st, "unit '%s': %s", unit_label(u), call);
    snprintf(u->failure, sizeof u->failure, "%s", ms_last_error());
    op_clear(u);
    free_unsharded(u);
    u->state = ST_FAILED;
    return st;
}

static ms_status record(ms_unit *u, ms_record_kind kind, ms_dtype dtype, int group_size, int64_t bytes) {
    if (u->nrecords == u->rcap) {
        int cap = u->rcap ? 2 * u->rcap : 16;
        unit_record *r = realloc(u->records, (size_t)cap * sizeof *r);
        if (!r) return ms__fail(MS_ERR_OOM, "unit '%s': out of memory recording a collective", unit_label(u));
        u->records = r;
        u->rcap = cap;
    }
    u->records[u->nrecords++] = (unit_record){kind, dtype, group_size, bytes};
    return MS_OK;
}

/* ---------------------------------------------------------------- element-wise kernels */

/* The element-wise step on n elements of raw buffers, on the unit's GPU (on_device) or on
 * the host, with the same rules (unit_math.h). */
static ms_status ew(const ms_unit *u, bool on_device, ms_ew_op op, void *dst, ms_dtype dd, double s, const void *src,
                    ms_dtype sd, bool round_src, int64_t n) {
    if (on_device) return ms__cuda_ew(u->device, op, dst, dd, s, src, sd, round_src, n);
    ms__ew(op, dst, dd, s, src, sd, round_src, n);
    return MS_OK;
}

/* ew on contiguous tensors of u (src may be NULL), where dst is: a src on the other side is
 * brought over first. */
static ms_status ew_tensor(const ms_unit *u, ms_ew_op op, ms_tensor *dst, double s, ms_tensor *src, bool round_src) {
    const bool dev = ms_tensor_device(dst) == MS_DEVICE_CUDA;
    ms_tensor *moved = NULL;
    ms_status st = MS_OK;
    if (src && (ms_tensor_device(src) == MS_DEVICE_CUDA) != dev) {
        st = ms_tensor_to_device(&moved, src, ms_tensor_device(dst), dev ? u->device : 0);
        src = moved;
    }
    if (!st)
        st = ew(u, dev, op, ms_tensor_data(dst), ms_tensor_dtype(dst), s, src ? ms_tensor_data(src) : NULL,
                src ? ms_tensor_dtype(src) : ms_tensor_dtype(dst), round_src, ms_tensor_numel(dst));
    ms_tensor_release(moved);
    return st;
}

/* ---------------------------------------------------------------- lifecycle */

static ms_status check_policy_dtype(const char *unit, const char *what, int d) {
    if (d == -1 || (ms__dtype_valid((ms_dtype)d) && ms_dtype_is_float((ms_dtype)d))) return MS_OK;
    if (ms__dtype_valid((ms_dtype)d))
        return ms__fail(MS_ERR_DTYPE, "unit '%s': %s %s is not a floating dtype", unit[0] ? unit : "<root>", what,
                        ms_dtype_name((ms_dtype)d));
    return ms__fail(MS_ERR_DTYPE, "unit '%s': %s %d is not a dtype (a floating ms_dtype, or -1 for unset)",
                    unit[0] ? unit : "<root>", what, d);
}

/* The k consecutive ranks of the shard group that hold one k-way shard together. */
static ms_status make_kgroup(ms_unit *u) {
    int *ranks = malloc((size_t)u->k * sizeof *ranks);
    if (!ranks) return ms__fail(MS_ERR_OOM, "unit '%s': out of memory", unit_label(u));
    int first = u->rank / u->k * u->k;
    for (int i = 0; i < u->k; i++) ranks[i] = ms_comm_world_rank(u->shard, first + i);
    ms_status st = ms_comm_group(u->shard, u->k, ranks, &u->kgroup);
    free(ranks);
    return st ? ms__wrap(st, "unit '%s': the %d-way reshard group", unit_label(u), u->k) : MS_OK;
}

ms_status ms_unit_new(ms_unit **out, const char *name, ms_comm *shard, ms_comm *replicate, int param_dtype,
                      int reduce_dtype, int reshard_after_forward) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(name);
    MS_NOT_NULL(shard);
    const ms_backend *be = shard->world->backend;
    if (be->device != MS_DEVICE_CPU && !be->takes_cpu)
        return ms__fail(MS_ERR_NOT_BUILT, "unit '%s': the unit runtime moves cpu tensors; the %s backend moves device "
                        "tensors", name, be->name);
    if (replicate && replicate->world != shard->world)
        return ms__fail(MS_ERR_ARG, "unit '%s': the shard and replicate comms belong to different worlds", name);
    ms_status st = check_policy_dtype(name, "param_dtype", param_dtype);
    if (!st) st = check_policy_dtype(name, "reduce_dtype", reduce_dtype);
    if (st) return st;
    const int W = ms_comm_size(shard);
    /* PyTorch's integer (_get_post_forward_mesh_info): 1 keeps, W frees, k keeps a k-way
     * shard; MS_RESHARD_FULL stands for its True.  u->k: 0 keep, 1 free, else k-way. */
    const int r = reshard_after_forward;
    if (r < 0 || (r >= 2 && (r > W || W % r)))
        return ms__fail(MS_ERR_ARG, "unit '%s': reshard_after_forward %d: expected MS_RESHARD_FULL (0, the whole shard "
                        "group), MS_RESHARD_KEEP (1) or a group size 2 <= k <= W that divides the shard size W = %d",
                        name, r, W);
    const int k = r == MS_RESHARD_KEEP ? 0 : (r == MS_RESHARD_FULL || r == W) ? 1 : r;

    ms_unit *u = calloc(1, sizeof *u);
    if (!u || !(u->name = strdup(name))) {
        free(u);
        return ms__fail(MS_ERR_OOM, "unit '%s': out of memory", name);
    }
    atomic_init(&u->refcount, 1);
    ms_comm_retain(shard);
    ms_comm_retain(replicate);
    u->shard = shard;
    u->replicate = replicate;
    u->W = W;
    u->R = replicate ? ms_comm_size(replicate) : 1;
    u->rank = ms_comm_rank(shard);
    u->k = k;
    u->policy_param = param_dtype;
    u->policy_reduce = reduce_dtype;
    u->state = ST_BUILDING;
    u->sync = true;
    u->device = be->device == MS_DEVICE_CUDA ? ms_nccl_device() : -1;
    st = cache_acquire(shard->world, ms_comm_world_rank(shard, u->rank), &u->cache);
    if (st || (k >= 2 && (st = make_kgroup(u)))) {
        ms_unit_release(u);
        return st;
    }
    *out = u;
    return ms__ok();
}

void ms_unit_retain(ms_unit *u) {
    if (u) atomic_fetch_add(&u->refcount, 1);
}

static void param_free(ms_unit *u, unit_param *p) {
    view_free(&p->shard);
    view_free(&p->grad_shard);
    buf_free(u, MS_BYTES_SHARDS, &p->padded);
    buf_free(u, MS_BYTES_GRADS, &p->grad_padded);
    buf_free(u, MS_BYTES_OPTIMIZER, &p->exp_avg);
    buf_free(u, MS_BYTES_OPTIMIZER, &p->exp_avg_sq);
    buf_free(u, MS_BYTES_OPTIMIZER, &p->master);
    unsharded_free(u, &p->full, &p->full_flat);
    unsharded_free(u, &p->grad_full, &p->grad_flat);
    buf_free(u, MS_BYTES_UNSHARDED, &p->grad_acc);
    free(p->fqn);
}

void ms_unit_release(ms_unit *u) {
    if (!u || atomic_fetch_sub(&u->refcount, 1) != 1) return;
    if (u->state == ST_GATHERING || u->state == ST_REDUCING) ms__async_wait(&u->op.ticket);
    op_clear(u);
    buf_free(u, MS_BYTES_UNSHARDED, &u->kept);
    for (int i = 0; i < u->nparams; i++) param_free(u, &u->params[i]);
    zero_free(u);
    cache_drop(u->cache, u);
    cache_release(u->cache);
    ms_comm_release(u->kgroup);
    ms_comm_release(u->replicate);
    ms_comm_release(u->shard);
    free(u->records);
    free(u->params);
    free(u->name);
    free(u);
}

ms_status ms_unit_add_param(ms_unit *u, const char *fqn, int ndim, const int64_t *shape, ms_dtype dtype, int dim,
                            int requires_grad) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(fqn);
    if (ndim > 0) MS_NOT_NULL(shape);
    if (u->state != ST_BUILDING)
        return ms__fail(MS_ERR_STATE, "unit '%s': add_param '%s': the unit is %s; parameters are added before "
                        "ms_unit_finalize", unit_label(u), fqn, state_name[u->state]);
    if (!ms__dtype_valid(dtype))
        return ms__fail(MS_ERR_DTYPE, "unit '%s': add_param '%s': invalid dtype %d", unit_label(u), fqn, (int)dtype);
    for (int i = 0; i < u->nparams; i++)
        if (!strcmp(u->params[i].fqn, fqn))
            return ms__fail(MS_ERR_ARG, "unit '%s': add_param: parameter '%s' is already in the unit", unit_label(u), fqn);
    if (requires_grad && !ms_dtype_is_float(dtype))
        return ms__fail(MS_ERR_DTYPE, "unit '%s': parameter '%s' is %s and cannot require gradients", unit_label(u), fqn,
                        ms_dtype_name(dtype));
    /* FSDP2 asks one stored dtype of the trainable parameters; frozen ones may differ (and
     * in a packed unit trainable ones too) */
    for (int i = 0; requires_grad && !u->packed && i < u->nparams; i++)
        if (u->params[i].requires_grad && u->params[i].dtype != dtype)
            return ms__fail(MS_ERR_DTYPE, "unit '%s': parameter '%s' is stored in %s but '%s' is stored in %s: FSDP "
                            "expects uniform original parameter dtype of the trainable parameters; shard them in "
                            "separate units, or pack them (ms_unit_set_packed)", unit_label(u), fqn, ms_dtype_name(dtype), u->params[i].fqn,
                            ms_dtype_name(u->params[i].dtype));
    int64_t local[MS_MAX_DIMS], offset, padded[MS_MAX_DIMS];
    ms_status st = ms_fsdp_shard(ndim, shape, u->W, u->rank, dim, local, &offset, padded);
    if (st) return ms__wrap(st, "unit '%s': add_param '%s'", unit_label(u), fqn);
    if (u->nparams == u->cap) {
        int cap = u->cap ? 2 * u->cap : 8;
        unit_param *ps = realloc(u->params, (size_t)cap * sizeof *ps);
        if (!ps) return ms__fail(MS_ERR_OOM, "unit '%s': out of memory adding '%s'", unit_label(u), fqn);
        u->params = ps;
        u->cap = cap;
    }
    unit_param *p = &u->params[u->nparams];
    *p = (unit_param){.ndim = ndim, .dim = dim < 0 ? dim + ndim : dim, .requires_grad = requires_grad != 0,
                      .dtype = dtype, .policy_param = -1, .policy_reduce = -1};
    memcpy(p->shape, shape, (size_t)ndim * sizeof *shape);
    memcpy(p->padded_shape, padded, (size_t)ndim * sizeof *padded);
    p->padded_numel = 1;
    for (int d = 0; d < ndim; d++) p->padded_numel *= padded[d];
    if (!(p->fqn = strdup(fqn))) st = ms__fail(MS_ERR_OOM, "unit '%s': out of memory adding '%s'", unit_label(u), fqn);
    if (!st) st = buf_new(u, MS_BYTES_SHARDS, &p->padded, ndim, padded, dtype, true);
    if (!st) st = ms_tensor_narrow(&p->shard, p->padded, p->dim, 0, local[p->dim]);
    if (st) {
        param_free(u, p);
        return st;
    }
    u->nparams++;
    return ms__ok();
}

ms_status ms_unit_set_packed(ms_unit *u, int packed) {
    MS_NOT_NULL(u);
    if (u->nparams || u->state != ST_BUILDING)
        return ms__fail(MS_ERR_STATE, "unit '%s': set_packed: the unit already holds parameters (or is finalized); "
                        "pack it before the first ms_unit_add_param", unit_label(u));
    u->packed = packed != 0;
    return ms__ok();
}

ms_status ms_unit_set_param_policy(ms_unit *u, int i, int param_dtype, int reduce_dtype) {
    MS_NOT_NULL(u);
    unit_param *p = NULL;
    ms_status st = param_at(u, "set_param_policy", i, &p);
    if (!st) st = check_state(u, "set_param_policy", ST(ST_BUILDING));
    if (st) return st;
    if (!u->packed)
        return ms__fail(MS_ERR_STATE, "unit '%s': set_param_policy '%s': the unit is not packed; a parameter has its own "
                        "policy in a packed unit (ms_unit_set_packed before the first add_param)", unit_label(u), p->fqn);
    if (p->fp8)
        return ms__fail(MS_ERR_STATE, "unit '%s': set_param_policy '%s': the parameter gathers in fp8 already; give it "
                        "its policy before ms_unit_set_fp8_all_gather (which checks its gather dtype)", unit_label(u),
                        p->fqn);
    char what[64 + 256];
    snprintf(what, sizeof what, "parameter '%.200s': param_dtype", p->fqn);
    st = check_policy_dtype(u->name, what, param_dtype);
    snprintf(what, sizeof what, "parameter '%.200s': reduce_dtype", p->fqn);
    if (!st) st = check_policy_dtype(u->name, what, reduce_dtype);
    if (st) return st;
    p->own_policy = true;
    p->policy_param = param_dtype;
    p->policy_reduce = reduce_dtype;
    return ms__ok();
}

ms_status ms_unit_finalize(ms_unit *u) {
    MS_NOT_NULL(u);
    if (u->state != ST_BUILDING && u->state != ST_FAILED)
        return ms__fail(MS_ERR_STATE, "unit '%s': finalize: the unit is already finalized (it is %s)", unit_label(u),
                        state_name[u->state]);
    ms_status st = check_state(u, "finalize", ST(ST_BUILDING));
    if (st) return st;
    /* the unit's stored dtype: its trainable parameters' (one, add_param checked), else the
     * first floating parameter's, else the first's */
    u->stored = MS_F32;
    for (int i = 0, best = -1; i < u->nparams; i++) {
        const unit_param *p = &u->params[i];
        const int rank = p->requires_grad ? 2 : ms_dtype_is_float(p->dtype) ? 1 : 0;
        if (rank > best) u->stored = p->dtype, best = rank;
    }
    /* FSDP2 (PyTorch 2.15, FSDPParam.init_dtype_attrs and unsharded_grad_dtype): param_dtype
     * unset when equal to the stored dtype or when the parameter is not floating point; a
     * gradient reduced in reduce_dtype, else in the parameter's stored dtype (2.15's
     * grad_dtype rule: fp32 for an fp32 parameter computed in bf16; before 2.15 it was
     * param_dtype).  Every parameter by its own policy (a packed unit's own ones, else the
     * unit's). */
    for (int i = 0; i < u->nparams; i++) {
        unit_param *p = &u->params[i];
        const int pd = p->own_policy ? p->policy_param : u->policy_param;
        const int rd = p->own_policy ? p->policy_reduce : u->policy_reduce;
        p->gather = pd >= 0 && pd != (int)p->dtype && ms_dtype_is_float(p->dtype) ? (ms_dtype)pd : p->dtype;
        p->reduce = rd >= 0 ? (ms_dtype)rd : p->dtype;
    }
    /* the unit's dtypes: its first trainable parameter's (else the unit policy's rule on the
     * stored dtype) */
    const int pd = u->policy_param, rd = u->policy_reduce;
    u->gather = pd >= 0 && pd != (int)u->stored && ms_dtype_is_float(u->stored) ? (ms_dtype)pd : u->stored;
    u->reduce = rd >= 0 ? (ms_dtype)rd : u->stored;
    for (int i = 0; i < u->nparams; i++)
        if (u->params[i].requires_grad) {
            u->gather = u->params[i].gather;
            u->reduce = u->params[i].reduce;
            break;
        }
    /* one reduce_scatter per reduce dtype of the trainable parameters */
    u->nred = 0;
    for (int i = 0; i < u->nparams; i++) {
        unit_param *p = &u->params[i];
        p->red = -1;
        if (!p->requires_grad) continue;
        for (int g = 0; g < u->nred && p->red < 0; g++)
            if (u->red_dtype[g] == p->reduce) p->red = g;
        if (p->red < 0) {
            if (u->nred == UNIT_MAX_REDUCE) /* cannot happen: a group a floating dtype */
                return ms__fail(MS_ERR_DTYPE, "unit '%s': more than %d reduce dtypes", unit_label(u), UNIT_MAX_REDUCE);
            p->red = u->nred;
            u->red_dtype[u->nred++] = p->reduce;
        }
    }
    u->gather_bytes = false;
    for (int i = 0; i < u->nparams; i++) {
        unit_param *p = &u->params[i];
        u->gather_bytes |= p->gather != u->gather || p->fp8; /* fp8: bytes (unit_fp8.c) */
    }
    int64_t S = 0, bytes;
    for (int i = 0; i < u->nparams; i++) {
        u->params[i].flat_offset = S;
        /* each padded shard fits in memory, so the sum fits */
        S += u->params[i].padded_numel *
             (u->gather_bytes ? (int64_t)(u->params[i].fp8 ? 1 : ms_dtype_size(u->params[i].gather)) : 1);
    }
    int64_t es = 1;
    for (int i = 0; i < u->nparams; i++) {
        const unit_param *p = &u->params[i];
        if (ms_dtype_size(p->gather) > es) es = ms_dtype_size(p->gather);
        if (ms_dtype_size(p->reduce) > es) es = ms_dtype_size(p->reduce);
    }
    if (!ms__mul_ok(S, u->W, &bytes) || !ms__mul_ok(bytes, es, &bytes))
        return ms__fail(MS_ERR_OVERFLOW, "unit '%s': the all-gather buffer of %d x %lld elements overflows int64",
                        unit_label(u), u->W, (long long)S);
    u->S = S;
    /* One parameter with nothing before its shard dim (dim 0, or leading dims of size 1):
     * rank q's block is rows [q*c, q*c + len_q) of the shard dim, so the blocks follow each
     * other in the full tensor's row-major order with all padding rows at the end, and the
     * gather and reduce buffers hold the full parameter and gradient as they are. */
    if (u->nparams == 1 && S > 0) {
        const unit_param *p = &u->params[0];
        int64_t outer = 1;
        for (int d = 0; d < p->dim; d++) outer *= p->shape[d];
        u->in_place = outer == 1 && !p->fp8;
    }
    u->state = ST_SHARDED;
    return ms__ok();
}

/* ---------------------------------------------------------------- accessors */

int ms_unit_param_count(const ms_unit *u) {
    MS_NOT_NULL_OR(u, -1);
    return u->nparams;
}
const char *ms_unit_name(const ms_unit *u) {
    MS_NOT_NULL_OR(u, NULL);
    return u->name;
}

const char *ms_unit_param_fqn(const ms_unit *u, int i) {
    MS_NOT_NULL_OR(u, NULL);
    return i >= 0 && i < u->nparams ? u->params[i].fqn : NULL;
}

ms_tensor *ms_unit_param_shard(ms_unit *u, int i) {
    MS_NOT_NULL_OR(u, NULL);
    unit_param *p = NULL;
    if (param_at(u, "param_shard", i, &p)) return NULL;
    ms__ok();
    return p->shard;
}

ms_status ms_unit_param_info(const ms_unit *u, int i, int *ndim, int64_t *shape, ms_dtype *stored, ms_dtype *gather,
                             int *requires_grad) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(ndim);
    MS_NOT_NULL(shape);
    MS_NOT_NULL(stored);
    MS_NOT_NULL(gather);
    MS_NOT_NULL(requires_grad);
    unit_param *p = NULL;
    ms_status st = param_at(u, "param_info", i, &p);
    if (st) return st;
    if ((st = check_state(u, "param_info", ~ST(ST_BUILDING)))) return st;
    *ndim = p->ndim;
    memcpy(shape, p->shape, (size_t)p->ndim * sizeof *shape);
    *stored = p->dtype;
    *gather = p->gather;
    *requires_grad = p->requires_grad;
    return ms__ok();
}

ms_status ms_unit_reduce_dtype(const ms_unit *u, ms_dtype *reduce) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(reduce);
    ms_status st = check_state(u, "reduce_dtype", ~ST(ST_BUILDING));
    if (st) return st;
    *reduce = u->reduce;
    return ms__ok();
}

ms_status ms_unit_param_reduce_dtype(const ms_unit *u, int i, ms_dtype *reduce) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(reduce);
    unit_param *p = NULL;
    ms_status st = param_at(u, "param_reduce_dtype", i, &p);
    if (!st) st = check_state(u, "param_reduce_dtype", ~ST(ST_BUILDING));
    if (st) return st;
    *reduce = p->reduce;
    return ms__ok();
}

ms_tensor *ms_unit_grad_shard(ms_unit *u, int i) {
    MS_NOT_NULL_OR(u, NULL);
    unit_param *p = NULL;
    if (param_at(u, "grad_shard", i, &p)) return NULL;
    ms__ok();
    return p->has_grad ? p->grad_shard : NULL;
}

/* The rows of p's shard dim that shard rank q holds: torch.chunk extents. */
static void rank_rows(const ms_unit *u, const unit_param *p, int q, int64_t *len, int64_t *off) {
    ms_chunk_extent(p->shape[p->dim], u->W, q, len, off);
}

ms_status ms_unit_param_offset(const ms_unit *u, int i, int *dim, int64_t *offset, int64_t *rows) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(dim);
    MS_NOT_NULL(offset);
    MS_NOT_NULL(rows);
    unit_param *p = NULL;
    ms_status st = param_at(u, "param_offset", i, &p);
    if (st) return st;
    *dim = p->dim;
    rank_rows(u, p, u->rank, rows, offset);
    return ms__ok();
}

ms_status ms_unit_load_full(ms_unit *u, int i, const ms_tensor *full) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(full);
    unit_param *p = NULL;
    ms_status st = param_at(u, "load_full", i, &p);
    if (st) return st;
    if ((st = check_state(u, "load_full", ST(ST_BUILDING) | ST(ST_SHARDED)))) return st;
    if (full->ndim != p->ndim || memcmp(full->shape, p->shape, (size_t)p->ndim * sizeof *p->shape)) {
        char a[256], b[256];
        return ms__fail(MS_ERR_SHAPE, "unit '%s': load_full '%s': the full tensor is %s but the parameter is %s",
                        unit_label(u), p->fqn, ms__shape_str(a, sizeof a, full->ndim, full->shape),
                        ms__shape_str(b, sizeof b, p->ndim, p->shape));
    }
    int64_t len, off;
    rank_rows(u, p, u->rank, &len, &off);
    ms_tensor *region = NULL, *master = NULL;
    st = ms_tensor_narrow(&region, (ms_tensor *)full, p->dim, off, len); /* a view; full is only read */
    if (!st) st = ms_tensor_copy(p->shard, region);
    /* The f32 master weights, once a step made them, are the parameter AdamW updates: they
     * take the loaded values in f32 (an f32 checkpoint's own bits), the shard their rounding. */
    if (!st && p->master && ms_tensor_numel(p->master)) {
        st = ms_tensor_view(&master, p->master, p->ndim, p->shard->shape);
        if (!st) st = ms_tensor_copy(master, region);
    }
    ms_tensor_release(master);
    ms_tensor_release(region);
    return st ? ms__wrap(st, "unit '%s': load_full '%s'", unit_label(u), p->fqn) : ms__ok();
}

/* ---------------------------------------------------------------- flat layouts */

/* Moves shard rank q's block of p between `full` (global shape) and `flat`, a 1-D buffer
 * holding q's padded block of p from element `at_elem`: full -> flat when to_flat, else
 * flat -> full, casting between their dtypes.  Only q's real rows move; packing (to_flat)
 * zeroes the padding rows after them in flat (only dim 0 pads, so they are the block's
 * tail), unpacking leaves them alone. */
static ms_status move_block(const ms_unit *u, const unit_param *p, int q, ms_tensor *full, ms_tensor *flat,
                            int64_t at_elem, bool to_flat) {
    int64_t len, off;
    rank_rows(u, p, q, &len, &off);
    const int64_t real = len ? p->padded_numel / p->padded_shape[p->dim] * len : 0;
    ms_status st = to_flat ? zero_elems(flat, at_elem + real, p->padded_numel - real) : MS_OK;
    ms_tensor *block = NULL, *shaped = NULL, *packed = NULL, *region = NULL;
    if (!st) st = ms_tensor_narrow(&block, flat, 0, at_elem, p->padded_numel);
    if (!st) st = ms_tensor_view(&shaped, block, p->ndim, p->padded_shape);
    if (!st) st = ms_tensor_narrow(&packed, shaped, p->dim, 0, len);
    if (!st) st = ms_tensor_narrow(&region, full, p->dim, off, len);
    if (!st) st = to_flat ? ms_tensor_copy(packed, region) : ms_tensor_copy(region, packed);
    ms_tensor_release(region);
    ms_tensor_release(packed);
    ms_tensor_release(shaped);
    ms_tensor_release(block);
    return st;
}

/* flat[at, at + bytes of blk) <-> blk, a contiguous tensor: the bytes of a block in a bytes
 * unit's u8 buffer. */
static ms_status block_bytes(ms_tensor *flat, int64_t at, ms_tensor *blk, bool to_flat) {
    ms_tensor *raw = NULL, *part = NULL;
    ms_status st = ms__tensor_bytes(&raw, blk);
    if (!st) st = ms_tensor_narrow(&part, flat, 0, at, ms_tensor_numel(raw));
    if (!st) st = to_flat ? ms_tensor_copy(part, raw) : ms_tensor_copy(raw, part);
    ms_tensor_release(part);
    ms_tensor_release(raw);
    return st;
}

/* move_block in either layout: in a bytes unit `at` counts bytes of the u8 buffer flat and
 * the block goes through blk (p's padded numel in its gather dtype), else blk is unused. */
static ms_status move_any(const ms_unit *u, const unit_param *p, int q, ms_tensor *full, ms_tensor *flat, int64_t at,
                          ms_tensor *blk, bool to_flat) {
    if (!u->gather_bytes) return move_block(u, p, q, full, flat, at, to_flat);
    ms_status st = to_flat ? move_block(u, p, q, full, blk, 0, true) : block_bytes(flat, at, blk, false);
    if (!st) st = to_flat ? block_bytes(flat, at, blk, true) : move_block(u, p, q, full, blk, 0, false);
    return st;
}

/* Host fast paths of a bytes unit.  bytes_pack: this rank's padded shard of p, cast to its
 * gather dtype, into the u8 buffer at byte `at` (through a small aligned buffer, since the
 * bytes of a parameter after another of an odd size need not be aligned for its dtype).
 * bytes_unpack: rank q's real rows of p from the u8 buffer into the unsharded parameter,
 * one copy, for a parameter whose rows are contiguous in the full tensor (nothing before its
 * shard dim). */
static void bytes_pack(const unit_param *p, unsigned char *flat, int64_t at) {
    enum { CHUNK = 2048 };
    const int gs = ms_dtype_size(p->gather), ss = ms_dtype_size(p->dtype);
    const unsigned char *src = ms_tensor_data(p->padded);
    if (p->gather == p->dtype) {
        memcpy(flat + at, src, (size_t)(p->padded_numel * gs));
        return;
    }
    double tmp[CHUNK]; /* room for CHUNK elements of any dtype, aligned for all */
    for (int64_t i = 0; i < p->padded_numel; i += CHUNK) {
        const int64_t n = p->padded_numel - i < CHUNK ? p->padded_numel - i : CHUNK;
        ms__cast_contig(tmp, p->gather, src + i * ss, p->dtype, n);
        memcpy(flat + at + i * gs, tmp, (size_t)(n * gs));
    }
}

static bool rows_contiguous(const unit_param *p) {
    int64_t outer = 1;
    for (int d = 0; d < p->dim; d++) outer *= p->shape[d];
    return outer == 1;
}

static void bytes_unpack(const ms_unit *u, const unit_param *p, int q, const unsigned char *flat, int64_t at) {
    int64_t len, off;
    rank_rows(u, p, q, &len, &off);
    const int64_t row = p->padded_numel / p->padded_shape[p->dim] * ms_dtype_size(p->gather);
    if (len) memcpy((unsigned char *)ms_tensor_data(p->full) + off * row, flat + at, (size_t)(len * row));
}

/* *out = the first elements of flat viewed as p's full tensor (in_place units). */
static ms_status full_view(const unit_param *p, ms_tensor *flat, ms_tensor **out) {
    int64_t numel = 1;
    for (int d = 0; d < p->ndim; d++) numel *= p->shape[d];
    ms_tensor *head = NULL;
    ms_status st = ms_tensor_narrow(&head, flat, 0, 0, numel);
    if (!st) st = ms_tensor_view(out, head, p->ndim, p->shape);
    ms_tensor_release(head);
    return st;
}

/* ---------------------------------------------------------------- the pending op */

/* The unit's collectives carry its name: ranks on different units disagree (comm.h). */
static ms_status run_all_gather(void *arg) {
    unit_op *op = arg;
    ms__coll_label = op->label;
    ms_status st = ms_all_gather(op->comm, op->flat, op->slice);
    ms__coll_label = NULL;
    return st;
}

static ms_status run_reduce(void *arg) {
    unit_op *op = arg;
    ms__coll_label = op->label;
    ms_status st = MS_OK;
    for (int g = 0; !st && g < op->nred; g++) {
        st = ms_reduce_scatter(op->comm, op->red[g].slice, op->red[g].flat, op->red[g].op);
        if (!st && op->replicate) st = ms_all_reduce(op->replicate, op->red[g].slice, op->red[g].replicate_op);
    }
    ms__coll_label = NULL;
    return st;
}

/* Queues u->op on this rank's communication thread; u enters `pending`. */
static ms_status op_submit(ms_unit *u, ms_async_fn fn, unit_state pending) {
    ms_comm *c = u->shard;
    ms_status st = ms__async_submit(c->world, ms_comm_world_rank(c, c->rank), &u->op.ticket, fn, &u->op);
    if (st) return st;
    u->state = pending;
    return MS_OK;
}

/* ---------------------------------------------------------------- unshard and reshard */

ms_status copy_into_flat(ms_tensor *flat, int64_t at, ms_tensor *src) {
    const int64_t n = ms_tensor_numel(src);
    ms_tensor *part = NULL, *line = NULL;
    ms_status st = ms_tensor_narrow(&part, flat, 0, at, n);
    if (!st) st = ms_tensor_view(&line, src, 1, &n);
    if (!st) st = ms_tensor_copy(part, line);
    ms_tensor_release(line);
    ms_tensor_release(part);
    return st;
}

/* u->flat = the (W, S) gather buffer holding this rank's chunk (from its shards, or from
 * the k-way shard); u->op the in-place all_gather that fills the rest. */
static ms_status prepare_gather(ms_unit *u) {
    const ms_dtype fd = u->gather_bytes ? MS_U8 : u->gather;
    const int64_t es = ms_dtype_size(fd), total = u->W * u->S;
    ms_status st = buf_new(u, MS_BYTES_UNSHARDED, &u->flat, 1, &total, fd, false);
    if (st) return st;
    u->op = (unit_op){.comm = u->state == ST_KWAY ? u->kgroup : u->shard, .flat = u->flat, .label = unit_label(u)};
    ms_comm *group = u->op.comm;
    if (u->state == ST_KWAY) {
        const int64_t seg = ms_tensor_numel(u->kept);
        st = ms_tensor_narrow(&u->op.slice, u->flat, 0, ms_comm_rank(group) * seg, seg);
        if (!st) st = ms_tensor_copy(u->op.slice, u->kept);
    } else {
        st = ms_tensor_narrow(&u->op.slice, u->flat, 0, u->rank * u->S, u->S);
        for (int i = 0; !st && i < u->nparams; i++) {
            const unit_param *p = &u->params[i];
            if (!p->padded_numel || p->fp8) continue; /* fp8: cast by the op (unit_fp8.c) */
            if (u->gather_bytes && u->device < 0) {
                bytes_pack(p, ms_tensor_data(u->flat), u->rank * u->S + p->flat_offset);
            } else if (u->gather_bytes) { /* cast into a block of the gather dtype, whose bytes go into the buffer */
                ms_tensor *blk = NULL;
                st = buf_new(u, MS_BYTES_UNSHARDED, &blk, 1, &p->padded_numel, p->gather, false);
                if (!st) st = copy_into_flat(blk, 0, p->padded);
                if (!st) st = block_bytes(u->flat, u->rank * u->S + p->flat_offset, blk, true);
                buf_free(u, MS_BYTES_UNSHARDED, &blk);
            } else if (u->device < 0)
                ms__cast_contig(at(u->flat, u->rank * u->S + p->flat_offset), u->gather, ms_tensor_data(p->padded),
                                p->dtype, p->padded_numel);
            else
                st = copy_into_flat(u->flat, u->rank * u->S + p->flat_offset, p->padded);
        }
    }
    for (int i = 0; !st && i < u->nparams; i++) { /* each fp8 parameter's amax all-reduce first */
        const unit_param *p = &u->params[i];
        const int es8 = ms_dtype_size(p->dtype);
        if (p->fp8) st = record(u, MS_RECORD_ALL_REDUCE, p->dtype, u->W, es8);
        if (!st && p->fp8 && u->replicate) st = record(u, MS_RECORD_ALL_REDUCE, p->dtype, u->R, es8);
    }
    if (!st) st = record(u, MS_RECORD_ALL_GATHER, fd, ms_comm_size(group), total * es);
    return st;
}

ms_status ms_unit_unshard(ms_unit *u) {
    MS_NOT_NULL(u);
    ms_status st = check_state(u, "unshard", ST(ST_SHARDED) | ST(ST_KEPT) | ST(ST_KWAY));
    if (st) return st;
    if (u->state == ST_KEPT) { /* MS_RESHARD_KEEP: nothing to gather */
        u->state = ST_UNSHARDED;
        return ms__ok();
    }
    st = prepare_gather(u);
    if (!st) st = op_submit(u, ms__unit_has_fp8(u) ? ms__unit_fp8_all_gather : run_all_gather, ST_GATHERING);
    if (st) {
        op_clear(u);
        return ms__wrap(st, "unit '%s': unshard", unit_label(u));
    }
    buf_free(u, MS_BYTES_UNSHARDED, &u->kept);
    return ms__ok();
}

/* Copy-out: the (W, S) buffer split by rank and parameter into the unsharded parameters;
 * an in_place unit's parameter views the buffer instead, which it keeps. */
static ms_status finish_unshard(ms_unit *u) {
    ms_status st = MS_OK;
    if (u->in_place) {
        unit_param *p = &u->params[0];
        if (!(st = full_view(p, u->flat, &p->full))) {
            p->full_flat = u->flat; /* its bytes stay counted as unsharded */
            u->flat = NULL;
        }
    } else {
        for (int i = 0; !st && i < u->nparams; i++) {
            unit_param *p = &u->params[i];
            ms_tensor *blk = NULL;
            if (p->fp8) {
                st = ms__unit_fp8_unpack(u, p);
                continue;
            }
            st = buf_new(u, MS_BYTES_UNSHARDED, &p->full, p->ndim, p->shape, p->gather, false);
            if (!st && u->gather_bytes && u->device < 0 && rows_contiguous(p)) {
                for (int q = 0; q < u->W; q++) bytes_unpack(u, p, q, ms_tensor_data(u->flat), q * u->S + p->flat_offset);
                continue;
            }
            if (!st && u->gather_bytes) st = buf_new(u, MS_BYTES_UNSHARDED, &blk, 1, &p->padded_numel, p->gather, false);
            for (int q = 0; !st && q < u->W; q++)
                st = move_any(u, p, q, p->full, u->flat, q * u->S + p->flat_offset, blk, false);
            buf_free(u, MS_BYTES_UNSHARDED, &blk);
        }
    }
    if (st) return st;
    op_clear(u);
    u->state = ST_UNSHARDED;
    return MS_OK;
}

/* u->kept = this rank's segment j = rank % k of the (W, S) layout, the chunks of shard
 * ranks [j*W/k, (j+1)*W/k), rebuilt from the unsharded parameters (padding zero). */
static ms_status keep_kway(ms_unit *u) {
    const int per = u->W / u->k, first = u->rank % u->k * per;
    const int64_t n = per * u->S;
    ms_status st = buf_new(u, MS_BYTES_UNSHARDED, &u->kept, 1, &n, u->gather_bytes ? MS_U8 : u->gather, false);
    for (int i = 0; !st && i < u->nparams; i++) {
        unit_param *p = &u->params[i];
        ms_tensor *blk = NULL;
        if (u->gather_bytes) st = buf_new(u, MS_BYTES_UNSHARDED, &blk, 1, &p->padded_numel, p->gather, false);
        for (int q = first; !st && q < first + per; q++)
            st = move_any(u, p, q, p->full, u->kept, (q - first) * u->S + p->flat_offset, blk, true);
        buf_free(u, MS_BYTES_UNSHARDED, &blk);
    }
    if (st) buf_free(u, MS_BYTES_UNSHARDED, &u->kept);
    return st;
}

ms_status ms_unit_reshard(ms_unit *u) {
    MS_NOT_NULL(u);
    ms_status st = check_state(u, "reshard", ST(ST_UNSHARDED));
    if (st) return st;
    if (u->k == 0) {
        u->state = ST_KEPT;
        return ms__ok();
    }
    if (u->k >= 2 && (st = keep_kway(u))) return ms__wrap(st, "unit '%s': reshard", unit_label(u));
    for (int i = 0; i < u->nparams; i++) unsharded_free(u, &u->params[i].full, &u->params[i].full_flat);
    u->state = u->k >= 2 ? ST_KWAY : ST_SHARDED;
    return ms__ok();
}

ms_status ms_unit_release_unsharded(ms_unit *u) {
    MS_NOT_NULL(u);
    ms_status st = check_state(u, "release_unsharded", ST_IDLE);
    if (st) return st;
    free_unsharded(u);
    cache_drop(u->cache, u);
    u->state = ST_SHARDED;
    return ms__ok();
}

ms_tensor *ms_unit_param_full(ms_unit *u, int i) {
    MS_NOT_NULL_OR(u, NULL);
    unit_param *p = NULL;
    if (param_at(u, "param_full", i, &p) || check_state(u, "param_full", ST(ST_UNSHARDED) | ST(ST_KEPT))) return NULL;
    ms__ok();
    return p->full;
}

/* ---------------------------------------------------------------- gradients */

ms_tensor *ms_unit_grad_full(ms_unit *u, int i) {
    MS_NOT_NULL_OR(u, NULL);
    unit_param *p = NULL;
    if (param_at(u, "grad_full", i, &p) || check_state(u, "grad_full", ST(ST_UNSHARDED))) return NULL;
    if (!p->requires_grad) {
        ms__fail(MS_ERR_ARG, "unit '%s': grad_full: parameter '%s' is frozen (requires_grad = 0) and has no gradient",
                 unit_label(u), p->fqn);
        return NULL;
    }
    if (!p->grad_full) {
        ms_status st;
        if (u->in_place && p->reduce == p->gather) { /* written straight into the reduce_scatter input */
            const int64_t total = u->W * u->S;
            st = buf_new(u, MS_BYTES_UNSHARDED, &p->grad_flat, 1, &total, p->gather, true);
            if (!st && (st = full_view(p, p->grad_flat, &p->grad_full))) buf_free(u, MS_BYTES_UNSHARDED, &p->grad_flat);
        } else {
            st = buf_new(u, MS_BYTES_UNSHARDED, &p->grad_full, p->ndim, p->shape, p->gather, true);
        }
        if (st) return NULL;
    }
    ms__ok();
    return p->grad_full;
}

ms_status ms_unit_set_requires_gradient_sync(ms_unit *u, int sync) {
    MS_NOT_NULL(u);
    u->sync = sync != 0;
    return ms__ok();
}

ms_status ms_unit_set_cpu_offload(ms_unit *u, int offload) {
    MS_NOT_NULL(u);
    if (u->nparams || u->state != ST_BUILDING)
        return ms__fail(MS_ERR_STATE, "unit '%s': set_cpu_offload: the unit already holds parameters; choose where "
                        "its shards live before the first ms_unit_add_param", unit_label(u));
    u->offload = offload != 0;
    return ms__ok();
}

ms_status ms_unit_set_gradient_divide_factor(ms_unit *u, double factor) {
    MS_NOT_NULL(u);
    if (!(factor == 0 || (isfinite(factor) && factor > 0)))
        return ms__fail(MS_ERR_ARG, "unit '%s': gradient divide factor %g: expected a finite factor > 0 (or 0 for "
                        "the default)", unit_label(u), factor);
    u->divide_factor = factor;
    return ms__ok();
}

/* How a reduce divides (PyTorch 2.15's _get_gradient_divide_factors and its one-rank
 * reduce-scatter path): the packed input is divided by prediv and multiplied by premul,
 * reduce_scatter with rs_op, all_reduce with ar_op, divided by post. */
typedef struct divide_plan {
    double prediv, premul, post;
    ms_op rs_op, ar_op;
} divide_plan;

static divide_plan divide_factors(const ms_unit *u, ms_dtype reduce) {
    const double n = (double)u->W * u->R;
    const bool custom = u->divide_factor > 0;
    const double f = custom ? u->divide_factor : n;
    divide_plan d = {.prediv = 1, .premul = 1, .post = 1, .rs_op = MS_OP_SUM, .ar_op = MS_OP_SUM};
    if (reduce == MS_F32 || reduce == MS_BF16) { /* no overflow risk: the collective divides */
        if (!custom) {
            if (n > 1) d.rs_op = d.ar_op = MS_OP_AVG;
        } else if (u->W == 1) {
            d.prediv = f; /* torch skips a one-rank reduce_scatter and copies input / factor */
        } else if (f == u->W) {
            d.rs_op = MS_OP_AVG; /* a custom factor equal to the shard group's size: AVG, then SUM */
        } else {
            d.premul = 1 / f; /* premul-sum, then SUM */
        }
        return d;
    }
    /* f16 and the other reduce dtypes: divide by about sqrt(f) before and after the sums.
     * (torch 2.15 with one shard rank and a custom factor also divides the input by the
     * whole factor there, dividing twice; that is not imitated.) */
    double pre = 1;
    while (fmod(f, pre) == 0 && f / pre > pre) pre *= 2;
    d.premul = 1 / pre; /* a power of two: exact */
    d.post = f / pre;
    return d;
}

/* p's gradient of this backward added into its sync-off accumulator (reduce dtype), then
 * freed. */
static ms_status accumulate(ms_unit *u, unit_param *p) {
    if (!p->grad_acc) {
        ms_status st = buf_new(u, MS_BYTES_UNSHARDED, &p->grad_acc, p->ndim, p->shape, p->reduce, true);
        if (st) return st;
    }
    /* each backward's gradient rounded to the reduce dtype, then added: FSDP2's gradients
     * are in the reduce dtype already (torch 2.15's grad_dtype) when they accumulate */
    ms_status st = ew_tensor(u, MS_EW_ADD, p->grad_acc, 0, p->grad_full, true);
    if (st) return st;
    unsharded_free(u, &p->grad_full, &p->grad_flat);
    return MS_OK;
}

/* u->op.red[g].flat = the (W, S_r) reduce_scatter input of reduce group g (the gradients
 * reduced in u->red_dtype[g]; one group unless a packed unit's parameters reduce in several
 * dtypes): for every shard rank q, the padded blocks of the group's gradients of this step
 * (accumulator + this backward's gradient when sync was off), pre-scaled (an in_place unit's
 * gradient was written there by the caller); u->op the in-place reduce_scatters and HSDP
 * all_reduces, one group after another. */
static ms_status prepare_reduce(ms_unit *u) {
    int64_t sr[UNIT_MAX_REDUCE] = {0};
    ms_status st = MS_OK;
    for (int i = 0; i < u->nparams; i++) {
        unit_param *p = &u->params[i];
        p->in_reduce = p->grad_full || p->grad_acc;
        if (!p->in_reduce) continue;
        p->grad_offset = sr[p->red];
        sr[p->red] += p->padded_numel;
        if (!st && p->grad_full && p->grad_acc) st = accumulate(u, p);
    }
    u->op = (unit_op){.comm = u->shard, .label = unit_label(u), .replicate = u->replicate};
    for (int g = 0; !st && g < u->nred; g++) {
        bool any = false;
        for (int i = 0; i < u->nparams; i++) any |= u->params[i].in_reduce && u->params[i].red == g;
        if (!any) continue; /* no gradient of this dtype this step */
        const ms_dtype rdt = u->red_dtype[g];
        const int64_t total = u->W * sr[g], es = ms_dtype_size(rdt);
        unit_reduce *r = &u->op.red[u->op.nred];
        r->dtype = rdt;
        r->group = g;
        unit_param *const in_place = u->in_place && u->params[0].grad_flat ? &u->params[0] : NULL;
        if (in_place) { /* the gradient was written into its (W, S) layout: nothing to pack */
            view_free(&in_place->grad_full);
            r->flat = in_place->grad_flat;
            in_place->grad_flat = NULL;
        } else {
            st = buf_new(u, MS_BYTES_UNSHARDED, &r->flat, 1, &total, rdt, false);
        }
        if (!st) u->op.nred++; /* op_clear frees it from here on */
        for (int q = 0; !st && !in_place && q < u->W; q++)
            for (int i = 0; !st && i < u->nparams; i++) {
                unit_param *p = &u->params[i];
                if (p->in_reduce && p->red == g)
                    st = move_block(u, p, q, p->grad_acc ? p->grad_acc : p->grad_full, r->flat,
                                    q * sr[g] + p->grad_offset, true);
            }
        if (st) break;
        const divide_plan d = divide_factors(u, rdt);
        if (d.prediv != 1 && (st = ew_tensor(u, MS_EW_DIV, r->flat, d.prediv, NULL, false))) break;
        if (d.premul != 1 && (st = ew_tensor(u, MS_EW_MUL, r->flat, d.premul, NULL, false))) break;
        r->op = d.rs_op;
        r->replicate_op = d.ar_op;
        r->post_divide = d.post;
        st = ms_tensor_narrow(&r->slice, r->flat, 0, u->rank * sr[g], sr[g]);
        if (!st) st = record(u, MS_RECORD_REDUCE_SCATTER, rdt, u->W, total * es);
        if (!st && u->replicate) st = record(u, MS_RECORD_ALL_REDUCE, rdt, u->R, sr[g] * es);
    }
    return st;
}

ms_status ms_unit_reduce_grads(ms_unit *u) {
    MS_NOT_NULL(u);
    ms_status st = check_state(u, "reduce_grads", ST_IDLE);
    if (st) return st;
    bool trainable = false, handed_out = false;
    for (int i = 0; i < u->nparams; i++) {
        trainable |= u->params[i].requires_grad;
        handed_out |= u->params[i].grad_full != NULL;
    }
    if (trainable && !handed_out)
        return ms__fail(MS_ERR_STATE, "unit '%s': reduce_grads: no gradient was handed out by ms_unit_grad_full "
                        "since the last reduce_grads (reduce after backward)", unit_label(u));
    if (trainable && u->sync) {
        st = prepare_reduce(u);
        if (!st) st = op_submit(u, run_reduce, ST_REDUCING);
        if (st) {
            op_clear(u);
            return ms__wrap(st, "unit '%s': reduce_grads", unit_label(u));
        }
        for (int i = 0; i < u->nparams; i++) buf_free(u, MS_BYTES_UNSHARDED, &u->params[i].grad_acc); /* packed */
    } else {
        for (int i = 0; i < u->nparams && !st; i++)
            if (u->params[i].grad_full) st = accumulate(u, &u->params[i]);
        if (st) return ms__wrap(st, "unit '%s': reduce_grads", unit_label(u));
        u->state = ST_SHARDED;
    }
    free_unsharded(u); /* FSDP2 reshards after backward; this backward's gradients were packed or accumulated */
    return ms__ok();
}

/* p's padded gradient shard <- elements [at, at + padded numel) of `reduced` (1-D, the reduce
 * dtype), cast to the stored dtype: FSDP2's assignment of the first reduced gradient. */
static ms_status assign_grad(unit_param *p, ms_tensor *reduced, int64_t at) {
    ms_tensor *part = NULL, *line = NULL;
    ms_status st = ms_tensor_narrow(&part, reduced, 0, at, p->padded_numel);
    if (!st) st = ms_tensor_view(&line, p->grad_padded, 1, &p->padded_numel);
    if (!st) st = ms_tensor_copy(line, part);
    ms_tensor_release(line);
    ms_tensor_release(part);
    return st;
}

/* Post-divide each reduce group's chunk, cast to the stored dtypes and assign to the gradient
 * shards that have no gradient (allocated by the first reduce; none after zero_grad),
 * accumulate into those that have one, as FSDP2 does, where the shards are: an offloaded
 * unit brings the reduced chunks to the host first. */
static ms_status finish_reduce(ms_unit *u) {
    const bool dev = shards_on_device(u);
    ms_tensor *host[UNIT_MAX_REDUCE] = {NULL}; /* an offloaded unit's reduced chunks on the host */
    ms_status st = MS_OK;
    for (int k = 0; !st && k < u->op.nred; k++) {
        unit_reduce *r = &u->op.red[k];
        if (u->device >= 0 && !dev) st = ms_tensor_to_device(&host[k], r->slice, MS_DEVICE_CPU, 0);
        if (!st && r->post_divide != 1)
            st = ew(u, dev, MS_EW_DIV, ms_tensor_data(host[k] ? host[k] : r->slice), r->dtype, r->post_divide, NULL,
                    r->dtype, false, ms_tensor_numel(r->slice));
    }
    for (int i = 0; !st && i < u->nparams; i++) {
        unit_param *p = &u->params[i];
        if (!p->in_reduce) continue;
        int k = 0;
        while (u->op.red[k].group != p->red) k++; /* prepare_reduce made p's group */
        ms_tensor *reduced = host[k] ? host[k] : u->op.red[k].slice;
        const ms_dtype rdt = u->op.red[k].dtype;
        if (!p->grad_padded) {
            int64_t len, off;
            rank_rows(u, p, u->rank, &len, &off);
            st = buf_new(u, MS_BYTES_GRADS, &p->grad_padded, p->ndim, p->padded_shape, p->dtype, true);
            if (!st) st = ms_tensor_narrow(&p->grad_shard, p->grad_padded, p->dim, 0, len);
        }
        if (!st && p->padded_numel && !p->has_grad) st = assign_grad(p, reduced, p->grad_offset);
        else if (!st && p->padded_numel)
            st = ew(u, dev, MS_EW_ADD, ms_tensor_data(p->grad_padded), p->dtype, 0,
                    (char *)ms_tensor_data(reduced) + p->grad_offset * ms_dtype_size(rdt), rdt, true, p->padded_numel);
        p->has_grad |= !st;
        p->in_reduce = false;
    }
    for (int k = 0; k < u->op.nred; k++) ms_tensor_release(host[k]);
    if (st) return st;
    op_clear(u);
    u->state = ST_SHARDED;
    return MS_OK;
}

ms_status ms_unit_wait(ms_unit *u) {
    MS_NOT_NULL(u);
    if (u->state == ST_FAILED) return check_state(u, "wait", 0);
    if (u->state != ST_GATHERING && u->state != ST_REDUCING) return ms__ok(); /* nothing pending */
    const bool gather = u->state == ST_GATHERING;
    ms_status st = ms__async_wait(&u->op.ticket);
    if (!st) st = gather ? finish_unshard(u) : finish_reduce(u);
    return st ? unit_fail(u, st, gather ? "unshard" : "reduce_grads") : ms__ok();
}

/* ---------------------------------------------------------------- zero_grad and clipping */

/* The gradient states: finalized, no reduce writing the gradient shards. */
#define ST_GRADS (ST_IDLE | ST(ST_GATHERING))

ms_status ms_unit_zero_grad(ms_unit *u) {
    MS_NOT_NULL(u);
    ms_status st = check_state(u, "zero_grad", ST_GRADS);
    if (st) return st;
    for (int i = 0; i < u->nparams; i++) u->params[i].has_grad = false; /* set_to_none: the buffers stay */
    return ms__ok();
}

ms_status ms_unit_grad_sq_norm(ms_unit *u, double *out) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(out);
    ms_status st = check_state(u, "grad_sq_norm", ST_GRADS);
    if (st) return st;
    double s = 0;
    for (int i = 0; i < u->nparams; i++) {
        const unit_param *p = &u->params[i];
        if (!p->has_grad) continue;
        const void *g = ms_tensor_data(p->grad_padded);
        const int64_t n = ms_tensor_numel(p->grad_shard);
        double part = 0;
        if (!shards_on_device(u)) part = ms__sum_sq(g, p->dtype, n);
        else if ((st = ms__cuda_sum_sq(u->device, g, p->dtype, n, &part))) return ms__wrap(st, "unit '%s'", unit_label(u));
        s += part;
    }
    *out = s / u->R; /* the R replicas hold the same shard */
    return ms__ok();
}

ms_status ms_unit_scale_grads(ms_unit *u, double scale) {
    MS_NOT_NULL(u);
    if (!isfinite(scale))
        return ms__fail(MS_ERR_ARG, "unit '%s': scale_grads: scale %g: expected a finite scale", unit_label(u), scale);
    ms_status st = check_state(u, "scale_grads", ST_GRADS);
    if (st) return st;
    for (int i = 0; i < u->nparams && !st; i++) {
        const unit_param *p = &u->params[i];
        if (p->has_grad)
            st = ew(u, shards_on_device(u), MS_EW_MUL, ms_tensor_data(p->grad_padded), p->dtype, scale, NULL,
                    p->dtype, false, ms_tensor_numel(p->grad_shard));
    }
    return st ? ms__wrap(st, "unit '%s': scale_grads", unit_label(u)) : ms__ok();
}

/* ---------------------------------------------------------------- audits */

int ms_unit_record_count(const ms_unit *u) {
    MS_NOT_NULL_OR(u, -1);
    return u->nrecords;
}

ms_status ms_unit_record(const ms_unit *u, int i, ms_record_kind *kind, ms_dtype *dtype, int *group_size, int64_t *bytes) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(kind);
    MS_NOT_NULL(dtype);
    MS_NOT_NULL(group_size);
    MS_NOT_NULL(bytes);
    if (i < 0 || i >= u->nrecords)
        return ms__fail(MS_ERR_ARG, "unit '%s': record %d: out of range (%d recorded)", unit_label(u), i, u->nrecords);
    const unit_record *r = &u->records[i];
    *kind = r->kind;
    *dtype = r->dtype;
    *group_size = r->group_size;
    *bytes = r->bytes;
    return ms__ok();
}

void ms_unit_clear_records(ms_unit *u) {
    MS_NOT_NULL_OR(u, );
    u->nrecords = 0;
}

ms_status unit_add_record(ms_unit *u, ms_record_kind kind, ms_dtype dtype, int group_size, int64_t bytes) {
    return record(u, kind, dtype, group_size, bytes);
}
