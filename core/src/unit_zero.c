/*
 * unit_zero.c: Megatron-FSDP buckets, one rank's ZeRO-0..3 runtime (moonshard.h,
 * "Megatron-FSDP buckets"): a mode of ms_unit whose parameters sit at the plan's offsets in
 * one flat buffer per bucket, each rank owning one contiguous slice of it.  The unit's own
 * machinery serves it: its name and parameter list, buf_new / buf_free (the byte counts of
 * ms_unit_bytes and the allocator's of ms_unit_rank_allocated), its records and its AdamW
 * mode; what the bucket adds lives in struct unit_zero.
 *
 *   buffer     what it holds (S = size, W = dp ranks, slice = [lo, lo + shard))
 *   params     no_shard: each parameter whole; optim, optim_grads: S elements; optim_grads_params:
 *              the slice (S with W = 1)
 *   full       optim_grads_params with W > 1: the gathered bucket (transient)
 *   grads      no_shard, optim: S elements; optim_grads(_params): the slice
 *   grad_full  optim_grads(_params) with W > 1: the whole gradient bucket (transient)
 *   main       f32 main weights: S (no_shard) or the slice
 *   exp_avg, exp_avg_sq, master: AdamW's state, packed: the slice's parameter elements only
 *
 * A parameter's piece is the part of it inside the slice: elements [s, e) of the parameter,
 * at bucket offset + s.  AdamW runs piece by piece with the shard units' kernels.
 */
#include "unit_internal.h"
#include "unit_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { NVIEWS = 7 }; /* ms_zero_view */

typedef struct zero_param {
    int64_t offset, numel; /* in the bucket */
    int64_t s, e;          /* the piece: elements [s, e) of the parameter in the rank's slice */
    int64_t state_at;      /* the piece's first element in the packed AdamW state */
    ms_tensor *own;        /* no_shard: the parameter itself (MS_BYTES_SHARDS) */
    ms_tensor *view[NVIEWS]; /* the views ms_unit_zero_tensor lent, by ms_zero_view */
} zero_param;

struct unit_zero {
    ms_zero_strategy strategy;
    ms_dtype dtype, gdt;
    bool trainable, main_f32, finalized, has_grad;
    int64_t size, shard, lo; /* the bucket, the slice's size and start */
    int64_t state_n;         /* parameter elements in the slice */
    zero_param *params;      /* parallel to u->params */
    ms_tensor *params_buf, *full, *grads, *grad_full, *main, *exp_avg, *exp_avg_sq, *master;
};

static const char *const strategy_name[] = {"no_shard", "optim", "optim_grads", "optim_grads_params"};

static ms_status zero_of(const ms_unit *u, const char *call, bool finalized, struct unit_zero **out) {
    if (!u->zero)
        return ms__fail(MS_ERR_STATE, "unit '%s': %s: not a Megatron-FSDP bucket (made by ms_unit_zero_new)",
                        unit_label(u), call);
    if (u->zero->finalized != finalized)
        return ms__fail(MS_ERR_STATE, "unit '%s': %s: the bucket is %s", unit_label(u), call,
                        finalized ? "not finalized (ms_unit_zero_finalize)" : "finalized already");
    *out = u->zero;
    return MS_OK;
}

static void view_drop(ms_tensor **t) {
    ms_tensor_release(*t);
    *t = NULL;
}

/* Frees a transient buffer and the views of kind `which` onto it (they keep its storage alive,
 * which would keep it out of the rank's cache). */
static void drop_transient(ms_unit *u, int which, ms_tensor **buf) {
    for (int i = 0; i < u->nparams; i++) view_drop(&u->zero->params[i].view[which]);
    buf_free(u, MS_BYTES_UNSHARDED, buf);
}

void zero_free(ms_unit *u) {
    struct unit_zero *z = u->zero;
    if (!z) return;
    for (int i = 0; i < u->nparams; i++) {
        for (int k = 0; k < NVIEWS; k++) view_drop(&z->params[i].view[k]);
        buf_free(u, MS_BYTES_SHARDS, &z->params[i].own);
    }
    buf_free(u, MS_BYTES_SHARDS, &z->params_buf);
    buf_free(u, MS_BYTES_SHARDS, &z->main);
    buf_free(u, MS_BYTES_UNSHARDED, &z->full);
    buf_free(u, MS_BYTES_GRADS, &z->grads);
    buf_free(u, MS_BYTES_UNSHARDED, &z->grad_full);
    buf_free(u, MS_BYTES_OPTIMIZER, &z->exp_avg);
    buf_free(u, MS_BYTES_OPTIMIZER, &z->exp_avg_sq);
    buf_free(u, MS_BYTES_OPTIMIZER, &z->master);
    free(z->params);
    free(z);
    u->zero = NULL;
}

/* ---------------------------------------------------------------- building */

ms_status ms_unit_zero_new(ms_unit **out, const char *name, ms_comm *dp, ms_zero_strategy strategy, ms_dtype dtype,
                           int requires_grad, int grad_dtype, int main_f32) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(name);
    MS_NOT_NULL(dp);
    if ((unsigned)strategy > MS_ZERO_OPTIM_GRADS_PARAMS)
        return ms__fail(MS_ERR_ARG, "bucket '%s': strategy %d: expected 0 (no_shard), 1 (optim), 2 (optim_grads) or 3 "
                        "(optim_grads_params)", name, (int)strategy);
    if (!ms__dtype_valid(dtype) || (requires_grad && !ms_dtype_is_float(dtype)))
        return ms__fail(MS_ERR_DTYPE, "bucket '%s': dtype %d: a trainable bucket takes a floating dtype", name, (int)dtype);
    const ms_dtype gdt = grad_dtype < 0 ? dtype : (ms_dtype)grad_dtype;
    if (requires_grad && (!ms__dtype_valid(gdt) || !ms_dtype_is_float(gdt)))
        return ms__fail(MS_ERR_DTYPE, "bucket '%s': grad_dtype %d: expected a floating dtype (or -1 for the "
                        "parameters')", name, grad_dtype);
    ms_unit *u = NULL;
    ms_status st = ms_unit_new(&u, name, dp, NULL, -1, -1, MS_RESHARD_FULL);
    if (st) return st;
    struct unit_zero *z = calloc(1, sizeof *z);
    if (!z) {
        ms_unit_release(u);
        return ms__fail(MS_ERR_OOM, "bucket '%s': out of memory", name);
    }
    *z = (struct unit_zero){.strategy = strategy, .dtype = dtype, .gdt = gdt, .trainable = requires_grad != 0,
                            .main_f32 = requires_grad && main_f32};
    u->zero = z;
    u->stored = u->gather = dtype;
    u->reduce = gdt;
    u->state = ST_ZERO;
    *out = u;
    return ms__ok();
}

ms_status ms_unit_zero_add_param(ms_unit *u, const char *fqn, int ndim, const int64_t *shape, int64_t offset) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(fqn);
    if (ndim > 0) MS_NOT_NULL(shape);
    struct unit_zero *z = NULL;
    ms_status st = zero_of(u, "zero_add_param", false, &z);
    if (st) return st;
    int64_t numel;
    if ((st = ms__check_shape(ndim, shape, &numel))) return ms__wrap(st, "bucket '%s': '%s'", unit_label(u), fqn);
    if (offset < 0) return ms__fail(MS_ERR_ARG, "bucket '%s': '%s' at offset %lld", unit_label(u), fqn, (long long)offset);
    for (int i = 0; i < u->nparams; i++)
        if (!strcmp(u->params[i].fqn, fqn))
            return ms__fail(MS_ERR_ARG, "bucket '%s': parameter '%s' is already in the bucket", unit_label(u), fqn);
    if (u->nparams == u->cap) {
        const int cap = u->cap ? 2 * u->cap : 8;
        unit_param *ps = realloc(u->params, (size_t)cap * sizeof *ps);
        if (ps) u->params = ps;
        zero_param *zs = ps ? realloc(z->params, (size_t)cap * sizeof *zs) : NULL;
        if (!zs) return ms__fail(MS_ERR_OOM, "bucket '%s': out of memory adding '%s'", unit_label(u), fqn);
        z->params = zs;
        u->cap = cap;
    }
    unit_param *p = &u->params[u->nparams];
    *p = (unit_param){.ndim = ndim, .requires_grad = z->trainable, .dtype = z->dtype, .gather = z->dtype,
                      .padded_numel = numel};
    if (ndim) memcpy(p->shape, shape, (size_t)ndim * sizeof *shape);
    if (!(p->fqn = strdup(fqn))) return ms__fail(MS_ERR_OOM, "bucket '%s': out of memory", unit_label(u));
    z->params[u->nparams] = (zero_param){.offset = offset, .numel = numel};
    u->nparams++;
    return ms__ok();
}

static int by_offset(const void *a, const void *b) {
    const zero_param *x = *(zero_param *const *)a, *y = *(zero_param *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

ms_status ms_unit_zero_finalize(ms_unit *u, int64_t size) {
    MS_NOT_NULL(u);
    struct unit_zero *z = NULL;
    ms_status st = zero_of(u, "zero_finalize", false, &z);
    if (st) return st;
    const int W = u->W;
    if (size < 0 || (z->strategy != MS_ZERO_NO_SHARD && size % W))
        return ms__fail(MS_ERR_ARG, "bucket '%s': size %lld: expected a size >= 0%s", unit_label(u), (long long)size,
                        z->strategy != MS_ZERO_NO_SHARD ? " that divides by the dp ranks (the plan pads it)" : "");
    /* the parameters inside [0, size), none overlapping */
    zero_param **order = malloc((size_t)(u->nparams ? u->nparams : 1) * sizeof *order);
    if (!order) return ms__fail(MS_ERR_OOM, "bucket '%s': out of memory", unit_label(u));
    for (int i = 0; i < u->nparams; i++) order[i] = &z->params[i];
    qsort(order, (size_t)u->nparams, sizeof *order, by_offset);
    for (int i = 0; i < u->nparams && !st; i++) {
        const zero_param *p = order[i];
        const int k = (int)(p - z->params);
        if (p->numel > size - p->offset)
            st = ms__fail(MS_ERR_ARG, "bucket '%s': parameter '%s' ([%lld, %lld)) ends past the bucket's %lld elements",
                          unit_label(u), u->params[k].fqn, (long long)p->offset, (long long)(p->offset + p->numel),
                          (long long)size);
        else if (i + 1 < u->nparams && p->offset + p->numel > order[i + 1]->offset)
            st = ms__fail(MS_ERR_ARG, "bucket '%s': parameters '%s' and '%s' overlap", unit_label(u), u->params[k].fqn,
                          u->params[order[i + 1] - z->params].fqn);
    }
    free(order);
    if (st) return st;
    z->size = size;
    const bool sliced = z->strategy != MS_ZERO_NO_SHARD;
    z->shard = sliced ? size / W : size;
    z->lo = sliced ? (int64_t)u->rank * z->shard : 0;
    for (int i = 0; i < u->nparams; i++) {
        zero_param *p = &z->params[i];
        const int64_t a = p->offset > z->lo ? p->offset : z->lo;
        const int64_t b = p->offset + p->numel < z->lo + z->shard ? p->offset + p->numel : z->lo + z->shard;
        p->s = b > a ? a - p->offset : 0;
        p->e = b > a ? b - p->offset : 0;
        p->state_at = z->state_n;
        z->state_n += p->e - p->s;
    }
    const int64_t whole = size, slice = z->shard;
    if (!sliced) {
        for (int i = 0; i < u->nparams && !st; i++)
            st = buf_new(u, MS_BYTES_SHARDS, &z->params[i].own, u->params[i].ndim, u->params[i].shape, z->dtype, true);
    } else {
        st = buf_new(u, MS_BYTES_SHARDS, &z->params_buf, 1, z->strategy == MS_ZERO_OPTIM_GRADS_PARAMS ? &slice : &whole,
                     z->dtype, true);
    }
    if (!st && z->main_f32) st = buf_new(u, MS_BYTES_SHARDS, &z->main, 1, &slice, MS_F32, true);
    if (!st && z->trainable)
        st = buf_new(u, MS_BYTES_GRADS, &z->grads, 1, z->strategy >= MS_ZERO_OPTIM_GRADS ? &slice : &whole, z->gdt, true);
    if (st) {
        zero_free(u);
        return st;
    }
    z->finalized = true;
    return ms__ok();
}

int ms_unit_is_zero(const ms_unit *u) {
    MS_NOT_NULL_OR(u, 0);
    ms__ok();
    return u->zero != NULL;
}

/* ---------------------------------------------------------------- views */

/* The buffer holding the whole bucket's parameters now (NULL: none; no_shard has none). */
static ms_tensor *whole_params(const ms_unit *u, const struct unit_zero *z) {
    if (z->strategy == MS_ZERO_NO_SHARD) return NULL;
    return z->strategy == MS_ZERO_OPTIM_GRADS_PARAMS && u->W > 1 ? z->full : z->params_buf;
}

/* The whole gradient bucket: the kept buffer, or the transient one (optim_grads(_params), W > 1). */
static bool grads_transient(const ms_unit *u, const struct unit_zero *z) {
    return z->strategy >= MS_ZERO_OPTIM_GRADS && u->W > 1;
}

/* *out = elements [at, at + n) of the contiguous buffer t taken flat, viewed with (ndim,
 * shape) (NULL: flat). */
static ms_status range_view(ms_tensor *t, int64_t at, int64_t n, int ndim, const int64_t *shape, ms_tensor **out) {
    ms_tensor *line = NULL, *part = NULL;
    const int64_t all = ms_tensor_numel(t);
    ms_status st = ms_tensor_view(&line, t, 1, &all);
    if (!st) st = ms_tensor_narrow(&part, line, 0, at, n);
    if (!st && shape) st = ms_tensor_view(out, part, ndim, shape);
    else if (!st) ms_tensor_retain(*out = part);
    ms_tensor_release(part);
    ms_tensor_release(line);
    return st;
}

static ms_tensor *piece_where(const struct unit_zero *z, const zero_param *p, int which, int64_t *at);

/* The flat buffer and the position in it of p's piece for view kind `which`, or NULL (an
 * empty piece is at 0). */
static ms_tensor *piece_at(const ms_unit *u, const struct unit_zero *z, const zero_param *p, int which, int64_t *at) {
    (void)u;
    ms_tensor *t = piece_where(z, p, which, at);
    if (p->e == p->s) *at = 0;
    return t;
}

static ms_tensor *piece_where(const struct unit_zero *z, const zero_param *p, int which, int64_t *at) {
    const int64_t b = p->offset + p->s; /* the piece's bucket offset */
    switch (which) {
    case MS_ZERO_PIECE_PARAM:
        if (p->own) {
            *at = p->s;
            return p->own;
        }
        *at = z->strategy == MS_ZERO_OPTIM_GRADS_PARAMS ? b - z->lo : b;
        return z->params_buf;
    case MS_ZERO_PIECE_GRAD: *at = z->strategy >= MS_ZERO_OPTIM_GRADS ? b - z->lo : b; return z->grads;
    case MS_ZERO_PIECE_EXP_AVG: *at = p->state_at; return z->exp_avg;
    case MS_ZERO_PIECE_EXP_AVG_SQ: *at = p->state_at; return z->exp_avg_sq;
    default:
        if (z->main) {
            *at = b - z->lo;
            return z->main;
        }
        *at = p->state_at;
        return z->master;
    }
}

/* Raw address of element `at` of a contiguous buffer. */
static void *elem(ms_tensor *t, int64_t at) {
    char *d = ms_tensor_data(t);
    return d ? d + at * ms_dtype_size(ms_tensor_dtype(t)) : NULL;
}

ms_tensor *ms_unit_zero_tensor(ms_unit *u, int i, ms_zero_view which) {
    MS_NOT_NULL_OR(u, NULL);
    struct unit_zero *z = NULL;
    unit_param *up = NULL;
    if (zero_of(u, "zero_tensor", true, &z) || param_at(u, "zero_tensor", i, &up)) return NULL;
    if ((unsigned)which >= NVIEWS) {
        ms__fail(MS_ERR_ARG, "bucket '%s': zero_tensor: view %d: expected an ms_zero_view (0 to 6)", unit_label(u),
                 (int)which);
        return NULL;
    }
    zero_param *p = &z->params[i];
    ms__ok();
    if (p->view[which]) return p->view[which];
    ms_status st = MS_OK;
    if (which == MS_ZERO_PARAM) {
        if (p->own) return p->own;
        ms_tensor *buf = whole_params(u, z);
        if (!buf) {
            ms__fail(MS_ERR_STATE, "bucket '%s': zero_tensor: '%s': the bucket's parameters are sharded "
                     "(optim_grads_params): ms_unit_zero_unshard first", unit_label(u), up->fqn);
            return NULL;
        }
        st = range_view(buf, p->offset, p->numel, up->ndim, up->shape, &p->view[which]);
    } else if (which == MS_ZERO_GRAD) {
        if (!z->trainable) return NULL;
        ms_tensor *buf = z->grads;
        if (grads_transient(u, z)) {
            if (!z->grad_full && (st = buf_new(u, MS_BYTES_UNSHARDED, &z->grad_full, 1, &z->size, z->gdt, true))) {
                ms__wrap(st, "bucket '%s': zero_tensor", unit_label(u));
                return NULL;
            }
            buf = z->grad_full;
        }
        st = range_view(buf, p->offset, p->numel, up->ndim, up->shape, &p->view[which]);
    } else {
        int64_t at = 0;
        ms_tensor *buf = piece_at(u, z, p, which, &at);
        if (!buf || (which == MS_ZERO_PIECE_GRAD && !z->trainable)) return NULL;
        st = range_view(buf, at, p->e - p->s, 0, NULL, &p->view[which]);
    }
    if (st) {
        ms__wrap(st, "bucket '%s': zero_tensor '%s'", unit_label(u), up->fqn);
        return NULL;
    }
    return p->view[which];
}

ms_status ms_unit_zero_piece(const ms_unit *u, int i, int64_t *start, int64_t *stop) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(start);
    MS_NOT_NULL(stop);
    struct unit_zero *z = NULL;
    unit_param *up = NULL;
    ms_status st = zero_of(u, "zero_piece", true, &z);
    if (!st) st = param_at(u, "zero_piece", i, &up);
    if (st) return st;
    *start = z->params[i].s;
    *stop = z->params[i].e;
    return ms__ok();
}

ms_status ms_unit_zero_load_full(ms_unit *u, int i, const ms_tensor *full) {
    MS_NOT_NULL(u);
    MS_NOT_NULL(full);
    struct unit_zero *z = NULL;
    unit_param *up = NULL;
    ms_status st = zero_of(u, "zero_load_full", true, &z);
    if (!st) st = param_at(u, "zero_load_full", i, &up);
    if (st) return st;
    zero_param *p = &z->params[i];
    if (ms_tensor_numel(full) != p->numel || !ms_tensor_is_contiguous(full))
        return ms__fail(MS_ERR_SHAPE, "bucket '%s': zero_load_full '%s': expected a contiguous tensor of %lld elements, "
                        "got %lld", unit_label(u), up->fqn, (long long)p->numel, (long long)ms_tensor_numel(full));
    ms_tensor *flat = (ms_tensor *)full, *src = NULL, *dst = NULL; /* full is only read */
    /* what the rank holds of the parameter: its piece under optim_grads_params, else all of it */
    const bool piece_only = z->strategy == MS_ZERO_OPTIM_GRADS_PARAMS;
    int64_t at = 0;
    ms_tensor *buf = piece_only ? piece_at(u, z, p, MS_ZERO_PIECE_PARAM, &at) : p->own ? p->own : z->params_buf;
    if (!piece_only) at = p->own ? 0 : p->offset;
    if (!st) st = range_view(flat, piece_only ? p->s : 0, piece_only ? p->e - p->s : p->numel, 0, NULL, &src);
    if (!st) st = range_view(buf, at, ms_tensor_numel(src), 0, NULL, &dst);
    if (!st) st = ms_tensor_copy(dst, src);
    view_drop(&dst);
    view_drop(&src);
    /* the piece's f32 main or master weights take the loaded values exactly */
    ms_tensor *w = z->trainable ? piece_at(u, z, p, MS_ZERO_PIECE_MAIN, &at) : NULL;
    if (!st && w && p->e > p->s) {
        st = range_view(flat, p->s, p->e - p->s, 0, NULL, &src);
        if (!st) st = range_view(w, at, p->e - p->s, 0, NULL, &dst);
        if (!st) st = ms_tensor_copy(dst, src);
        view_drop(&dst);
        view_drop(&src);
    }
    return st ? ms__wrap(st, "bucket '%s': zero_load_full '%s'", unit_label(u), up->fqn) : ms__ok();
}

/* ---------------------------------------------------------------- collectives */

/* The bucket's collectives carry its name: ranks on different buckets disagree (comm.h). */
static ms_status gather(ms_unit *u, ms_tensor *out, ms_tensor *in) {
    ms__coll_label = unit_label(u);
    ms_status st = ms_all_gather(u->shard, out, in);
    ms__coll_label = NULL;
    if (!st) st = unit_add_record(u, MS_RECORD_ALL_GATHER, ms_tensor_dtype(out), u->W, ms_tensor_nbytes(out));
    return st;
}

ms_status ms_unit_zero_unshard(ms_unit *u) {
    MS_NOT_NULL(u);
    struct unit_zero *z = NULL;
    ms_status st = zero_of(u, "zero_unshard", true, &z);
    if (st || z->strategy != MS_ZERO_OPTIM_GRADS_PARAMS || u->W == 1) return st ? st : ms__ok();
    if (z->full)
        return ms__fail(MS_ERR_STATE, "bucket '%s': zero_unshard: the bucket is unsharded already (ms_unit_zero_reshard "
                        "first)", unit_label(u));
    st = buf_new(u, MS_BYTES_UNSHARDED, &z->full, 1, &z->size, z->dtype, false);
    if (!st) st = gather(u, z->full, z->params_buf);
    if (st) {
        buf_free(u, MS_BYTES_UNSHARDED, &z->full);
        return ms__wrap(st, "bucket '%s': zero_unshard", unit_label(u));
    }
    return ms__ok();
}

ms_status ms_unit_zero_reshard(ms_unit *u) {
    MS_NOT_NULL(u);
    struct unit_zero *z = NULL;
    ms_status st = zero_of(u, "zero_reshard", true, &z);
    if (st) return st;
    if (z->full) {
        drop_transient(u, MS_ZERO_PARAM, &z->full);
    }
    return ms__ok();
}

ms_status ms_unit_zero_reduce_grads(ms_unit *u) {
    MS_NOT_NULL(u);
    struct unit_zero *z = NULL;
    ms_status st = zero_of(u, "zero_reduce_grads", true, &z);
    if (st || !z->trainable) return st ? st : ms__ok();
    const bool transient = grads_transient(u, z);
    ms_tensor *whole = transient ? z->grad_full : z->grads, *slice = NULL;
    if (!whole)
        return ms__fail(MS_ERR_STATE, "bucket '%s': zero_reduce_grads: no gradient was handed out (MS_ZERO_GRAD) since "
                        "the last reduce", unit_label(u));
    const int W = u->W;
    const int64_t gs = ms_dtype_size(z->gdt);
    if (W > 1) {
        /* Megatron-FSDP pre-scales by 1/dp, then sums */
        ms__ew(MS_EW_MUL, ms_tensor_data(whole), z->gdt, 1.0 / W, NULL, z->gdt, false, z->size);
        ms__coll_label = unit_label(u);
        if (z->strategy == MS_ZERO_NO_SHARD) {
            st = ms_all_reduce(u->shard, whole, MS_OP_SUM);
            if (!st) st = unit_add_record(u, MS_RECORD_ALL_REDUCE, z->gdt, W, z->size * gs);
        } else {
            st = range_view(whole, z->lo, z->shard, 0, NULL, &slice);
            if (!st) st = ms_reduce_scatter(u->shard, slice, whole, MS_OP_SUM); /* in place */
            if (!st) st = unit_add_record(u, MS_RECORD_REDUCE_SCATTER, z->gdt, W, z->size * gs);
        }
        ms__coll_label = NULL;
        if (!st && transient)
            ms__ew(MS_EW_ADD, ms_tensor_data(z->grads), z->gdt, 0, ms_tensor_data(slice), z->gdt, false, z->shard);
        view_drop(&slice);
    }
    if (transient) {
        drop_transient(u, MS_ZERO_GRAD, &z->grad_full);
    }
    if (st) return ms__wrap(st, "bucket '%s': zero_reduce_grads", unit_label(u));
    z->has_grad = true;
    return ms__ok();
}

ms_status ms_unit_zero_clear_grads(ms_unit *u) {
    MS_NOT_NULL(u);
    struct unit_zero *z = NULL;
    ms_status st = zero_of(u, "zero_clear_grads", true, &z);
    if (st) return st;
    if (z->grads) zero_elems(z->grads, 0, ms_tensor_numel(z->grads));
    if (z->grad_full) {
        drop_transient(u, MS_ZERO_GRAD, &z->grad_full);
    }
    z->has_grad = false;
    return ms__ok();
}

/* ---------------------------------------------------------------- AdamW */

/* The packed state of the slice's parameter elements, made once: zero moments (f32, or the
 * stored dtype with MS_ADAMW_TORCH and no main weights), f32 master weights (MS_ADAMW_MASTER,
 * stored dtype not f32, no main weights), and the main or master weights from the parameters. */
static ms_status state_make(ms_unit *u, struct unit_zero *z) {
    if (z->exp_avg) return MS_OK;
    const bool torch = u->adamw == MS_ADAMW_TORCH && !z->main;
    const ms_dtype mdt = torch ? z->dtype : MS_F32;
    ms_status st = buf_new(u, MS_BYTES_OPTIMIZER, &z->exp_avg, 1, &z->state_n, mdt, true);
    if (!st) st = buf_new(u, MS_BYTES_OPTIMIZER, &z->exp_avg_sq, 1, &z->state_n, mdt, true);
    if (!st && !z->main && !torch && z->dtype != MS_F32)
        st = buf_new(u, MS_BYTES_OPTIMIZER, &z->master, 1, &z->state_n, MS_F32, true);
    for (int i = 0; !st && (z->main || z->master) && i < u->nparams; i++) {
        const zero_param *p = &z->params[i];
        int64_t at = 0, wat = 0;
        ms_tensor *src = piece_at(u, z, p, MS_ZERO_PIECE_PARAM, &at), *w = piece_at(u, z, p, MS_ZERO_PIECE_MAIN, &wat);
        if (p->e > p->s) ms__cast_contig(elem(w, wat), MS_F32, elem(src, at), z->dtype, p->e - p->s);
    }
    u->adamw_made = true;
    return st;
}

ms_status ms_unit_zero_make_state(ms_unit *u) {
    MS_NOT_NULL(u);
    struct unit_zero *z = NULL;
    ms_status st = zero_of(u, "zero_make_state", true, &z);
    if (st) return st;
    if (z->trainable && (st = state_make(u, z))) return ms__wrap(st, "bucket '%s': make_state", unit_label(u));
    return ms__ok();
}

ms_status ms_unit_zero_adamw_step(ms_unit *u, double lr, double beta1, double beta2, double eps, double weight_decay,
                                  int64_t step) {
    MS_NOT_NULL(u);
    struct unit_zero *z = NULL;
    ms_status st = zero_of(u, "zero_adamw_step", true, &z);
    if (st) return st;
    if (!(lr >= 0) || !(eps >= 0) || !(weight_decay >= 0) || !(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1) ||
        step < 1)
        return ms__fail(MS_ERR_ARG, "bucket '%s': adamw_step: lr %g, betas (%g, %g), eps %g, weight_decay %g, step %lld: "
                        "expected lr, eps, weight_decay >= 0, 0 <= beta < 1 and step >= 1", unit_label(u), lr, beta1,
                        beta2, eps, weight_decay, (long long)step);
    if (z->trainable && z->has_grad) {
        if ((st = state_make(u, z))) return ms__wrap(st, "bucket '%s': adamw_step", unit_label(u));
        const double t = (double)step;
        ms_adamw_hyper h = {.d = {.decay = 1 - lr * weight_decay, .w1 = 1 - beta1, .b2 = beta2, .c2 = 1 - beta2,
                                  .step_size = lr / (1 - pow(beta1, t)), .bc2_sqrt = pow(1 - pow(beta2, t), 0.5),
                                  .eps = eps}};
        h.decay = (float)h.d.decay, h.w1 = (float)h.d.w1, h.b2 = (float)h.d.b2, h.c2 = (float)h.d.c2;
        h.step_size = (float)h.d.step_size, h.bc2_sqrt = (float)h.d.bc2_sqrt, h.eps = (float)h.d.eps;
        for (int i = 0; i < u->nparams && !st; i++) {
            const zero_param *p = &z->params[i];
            const int64_t n = p->e - p->s;
            if (!n) continue;
            int64_t pat = 0, gat = 0, wat = 0;
            ms_tensor *pb = piece_at(u, z, p, MS_ZERO_PIECE_PARAM, &pat), *gb = piece_at(u, z, p, MS_ZERO_PIECE_GRAD, &gat);
            ms_tensor *wb = piece_at(u, z, p, MS_ZERO_PIECE_MAIN, &wat);
            void *param = elem(pb, pat), *m = elem(z->exp_avg, p->state_at), *v = elem(z->exp_avg_sq, p->state_at);
            const void *grad = elem(gb, gat);
            if (wb) { /* f32 main or master weights, rounded into the parameters */
                ms__adamw(elem(wb, wat), m, v, grad, z->gdt, param, z->dtype, n, &h);
            } else if (z->dtype == MS_F32) {
                ms__adamw(param, m, v, grad, z->gdt, NULL, MS_F32, n, &h);
            } else { /* torch.optim.AdamW on the stored parameters: the gradient in their dtype */
                void *g = (void *)grad;
                if (z->gdt != z->dtype) {
                    if (!(g = malloc((size_t)(n * ms_dtype_size(z->dtype)))))
                        st = ms__fail(MS_ERR_OOM, "bucket '%s': adamw_step: out of memory", unit_label(u));
                    else ms__cast_contig(g, z->dtype, grad, z->gdt, n);
                }
                if (!st) ms__adamw_torch(param, m, v, g, z->dtype, n, &h);
                if (g != grad) free(g);
            }
        }
    }
    /* optim, optim_grads: every rank's updated slice into the parameter buffer */
    if (!st && (z->strategy == MS_ZERO_OPTIM || z->strategy == MS_ZERO_OPTIM_GRADS) && u->W > 1) {
        ms_tensor *slice = NULL;
        st = range_view(z->params_buf, z->lo, z->shard, 0, NULL, &slice);
        if (!st) st = gather(u, z->params_buf, slice); /* in place */
        view_drop(&slice);
    }
    return st ? ms__wrap(st, "bucket '%s': adamw_step (%s)", unit_label(u), strategy_name[z->strategy]) : ms__ok();
}
