/*
 * tensor.c: refcounted storage and tensors (cpu, meta, cuda), views, copy with cast, fill.
 *
 * A tensor is (storage, element offset, shape, strides, dtype).  Views (narrow, view,
 * chunk) make a new tensor over the same storage, which they retain; the storage is freed
 * when the last tensor on it is released, unless it wraps memory the caller owns.
 * Meta tensors have a storage with no memory: every shape rule applies, no data moves.
 * CUDA tensors hold device memory (cuda.h): copies and fills on them run as kernels (the
 * casts with the CPU's scalar rules), and a copy between devices goes through one plain
 * memcpy of the source's bytes, the cast done on the destination's side.
 */
#include "cuda.h"
#include "ms_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- shapes */

ms_status ms__check_shape(int ndim, const int64_t *shape, int64_t *numel) {
    if (ndim < 0 || ndim > MS_MAX_DIMS)
        return ms__fail(MS_ERR_SHAPE, "a tensor has 0 to %d dims, got %d", MS_MAX_DIMS, ndim);
    if (ndim > 0 && !shape) return ms__fail(MS_ERR_ARG, "shape is NULL");
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return ms__fail(MS_ERR_SHAPE, "size of dim %d is %lld; sizes must be >= 0", i,
                            (long long)shape[i]);
        if (!ms__mul_ok(n, shape[i], &n)) {
            char buf[256];
            return ms__fail(MS_ERR_OVERFLOW, "shape %s has more than 2^63 elements",
                            ms__shape_str(buf, sizeof buf, ndim, shape));
        }
    }
    *numel = n;
    return MS_OK;
}

static void contiguous_strides(int ndim, const int64_t *shape, int64_t *stride) {
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        stride[i] = s;
        s *= shape[i] > 0 ? shape[i] : 1;
    }
}

/* ---------------------------------------------------------------- lifetime */

static void free_data(ms_device_type device, int device_index, void *data) {
    if (device == MS_DEVICE_CUDA) ms__cuda_free(device_index, data);
    else free(data);
}

/* ---------------------------------------------------------------- allocation accounts */

static _Thread_local ms__account_scope current_account; /* this thread's (ms__account_enter) */

ms__account *ms__account_new(void) {
    ms__account *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    atomic_init(&a->refcount, 1);
    for (int c = 0; c < MS__ACCOUNT_CATS; c++) atomic_init(&a->bytes[c], 0);
    return a;
}

void ms__account_release(ms__account *a) {
    if (a && atomic_fetch_sub(&a->refcount, 1) == 1) free(a);
}

ms__account_scope ms__account_enter(ms__account *a, int cat) {
    const ms__account_scope previous = current_account;
    current_account = (ms__account_scope){a, cat};
    return previous;
}

void ms__account_leave(ms__account_scope previous) { current_account = previous; }

/* Counts an owned allocation of s in this thread's account, if any. */
static void account_storage(ms_storage *s) {
    ms__account *a = current_account.account;
    if (!a || !s->owned || !s->data) return;
    atomic_fetch_add(&a->refcount, 1);
    atomic_fetch_add(&a->bytes[current_account.cat], s->nbytes);
    s->account = a;
    s->account_cat = current_account.cat;
}

static void storage_release(ms_storage *s) {
    if (s && atomic_fetch_sub(&s->refcount, 1) == 1) {
        if (s->owned) free_data(s->device, s->device_index, s->data);
        if (s->account) {
            atomic_fetch_sub(&s->account->bytes[s->account_cat], s->nbytes);
            ms__account_release(s->account);
        }
        free(s);
    }
}

/* A tensor over storage s (retained here), contiguous, offset 0. */
static ms_status tensor_make(ms_tensor **out, ms_storage *s, int ndim, const int64_t *shape,
                             ms_dtype dtype) {
    ms_tensor *t = calloc(1, sizeof *t);
    if (!t) return ms__fail(MS_ERR_OOM, "out of memory allocating a tensor header");
    atomic_init(&t->refcount, 1);
    atomic_fetch_add(&s->refcount, 1);
    t->storage = s;
    t->ndim = ndim;
    t->dtype = dtype;
    if (ndim) memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    contiguous_strides(ndim, shape, t->stride);
    *out = t;
    return ms__ok();
}

static ms_status storage_new(ms_storage **out, void *data, int64_t nbytes, bool owned,
                             ms_device_type device, int device_index) {
    ms_storage *s = calloc(1, sizeof *s);
    if (!s) return ms__fail(MS_ERR_OOM, "out of memory allocating a storage header");
    atomic_init(&s->refcount, 0);
    s->data = data;
    s->nbytes = nbytes;
    s->owned = owned;
    s->device = device;
    s->device_index = device_index;
    account_storage(s);
    *out = s;
    return MS_OK;
}

static ms_status new_with_storage(ms_tensor **out, void *data, int64_t nbytes, bool owned,
                                  ms_device_type device, int device_index, int ndim,
                                  const int64_t *shape, ms_dtype dtype) {
    ms_storage *s = NULL;
    ms_status st = storage_new(&s, data, nbytes, owned, device, device_index);
    if (st) {
        if (owned) free_data(device, device_index, data);
        return st;
    }
    atomic_fetch_add(&s->refcount, 1); /* held while the tensor is made */
    st = tensor_make(out, s, ndim, shape, dtype);
    storage_release(s);
    return st;
}

ms_status ms_device_parse(const char *name, ms_device_type *type, int *index) {
    MS_NOT_NULL(name);
    MS_NOT_NULL(type);
    MS_NOT_NULL(index);
    *index = 0;
    if (strcmp(name, "cpu") == 0) *type = MS_DEVICE_CPU;
    else if (strcmp(name, "meta") == 0) *type = MS_DEVICE_META;
    else if (strncmp(name, "cuda", 4) == 0) {
        *type = MS_DEVICE_CUDA;
        if (name[4] == ':') {
            char *end;
            long v = strtol(name + 5, &end, 10);
            if (end == name + 5 || *end || v < 0 || v > 1023)
                return ms__fail(MS_ERR_DEVICE, "bad device '%s' (expected cuda:N with N >= 0)", name);
            *index = (int)v;
        } else if (name[4]) {
            return ms__fail(MS_ERR_DEVICE, "unknown device '%s' (expected cpu, meta or cuda:N)", name);
        }
    } else
        return ms__fail(MS_ERR_DEVICE, "unknown device '%s' (expected cpu, meta or cuda:N)", name);
    return ms__ok();
}

ms_status ms_tensor_new(ms_tensor **out, int ndim, const int64_t *shape, ms_dtype dtype,
                        ms_device_type device, int device_index) {
    MS_NOT_NULL(out);
    if (ndim > 0) MS_NOT_NULL(shape);
    if (!ms__dtype_valid(dtype)) return ms__fail(MS_ERR_DTYPE, "tensor_new: invalid dtype %d", (int)dtype);
    int64_t numel, nbytes;
    ms_status st = ms__check_shape(ndim, shape, &numel);
    if (st) return ms__wrap(st, "tensor_new");
    if (!ms__mul_ok(numel, ms_dtype_size(dtype), &nbytes))
        return ms__fail(MS_ERR_OVERFLOW, "tensor_new: %lld elements of %s overflow int64 bytes",
                        (long long)numel, ms_dtype_name(dtype));
    switch (device) {
    case MS_DEVICE_META:
        return new_with_storage(out, NULL, nbytes, false, device, 0, ndim, shape, dtype);
    case MS_DEVICE_CPU: {
        void *data = NULL;
        if (nbytes > 0) {
            if ((uint64_t)nbytes > (uint64_t)SIZE_MAX || !(data = calloc(1, (size_t)nbytes))) {
                char buf[256];
                return ms__fail(MS_ERR_OOM, "tensor_new: cannot allocate %lld bytes for %s %s",
                                (long long)nbytes, ms_dtype_name(dtype),
                                ms__shape_str(buf, sizeof buf, ndim, shape));
            }
        }
        return new_with_storage(out, data, nbytes, true, device, 0, ndim, shape, dtype);
    }
    case MS_DEVICE_CUDA: {
        void *data = NULL;
        if (device_index < 0) return ms__fail(MS_ERR_DEVICE, "tensor_new: device index %d < 0", device_index);
        if (nbytes > 0 && (st = ms__cuda_alloc(device_index, nbytes, &data)))
            return ms__wrap(st, "tensor_new: %s on cuda:%d", ms_dtype_name(dtype), device_index);
        return new_with_storage(out, data, nbytes, true, device, device_index, ndim, shape, dtype);
    }
    case MS_DEVICE_INVALID:
        break;
    }
    return ms__fail(MS_ERR_DEVICE, "tensor_new: invalid device %d", (int)device);
}

/* A tensor over memory the caller owns, on the device given (fn names the public call in
 * errors; out and shape checked there). */
static ms_status wrap(const char *fn, ms_tensor **out, void *data, int ndim, const int64_t *shape, ms_dtype dtype,
                      ms_device_type device, int device_index) {
    if (!ms__dtype_valid(dtype)) return ms__fail(MS_ERR_DTYPE, "%s: invalid dtype %d", fn, (int)dtype);
    int64_t numel, nbytes;
    ms_status st = ms__check_shape(ndim, shape, &numel);
    if (st) return ms__wrap(st, "%s", fn);
    if (!ms__mul_ok(numel, ms_dtype_size(dtype), &nbytes))
        return ms__fail(MS_ERR_OVERFLOW, "%s: byte count overflows int64", fn);
    if (!data && nbytes > 0) return ms__fail(MS_ERR_ARG, "%s: data is NULL for %lld bytes", fn, (long long)nbytes);
    if (device == MS_DEVICE_CUDA && (st = ms__cuda_check_pointer(device_index, data, nbytes)))
        return ms__wrap(st, "%s", fn);
    return new_with_storage(out, data, nbytes, false, device, device == MS_DEVICE_CUDA ? device_index : 0, ndim,
                            shape, dtype);
}

ms_status ms_tensor_wrap(ms_tensor **out, void *data, int ndim, const int64_t *shape, ms_dtype dtype) {
    MS_NOT_NULL(out);
    if (ndim > 0) MS_NOT_NULL(shape);
    return wrap(__func__, out, data, ndim, shape, dtype, MS_DEVICE_CPU, 0);
}

ms_status ms_tensor_wrap_device(ms_tensor **out, void *data, int ndim, const int64_t *shape, ms_dtype dtype,
                                ms_device_type device, int device_index) {
    MS_NOT_NULL(out);
    if (ndim > 0) MS_NOT_NULL(shape);
    if (device != MS_DEVICE_CPU && device != MS_DEVICE_CUDA)
        return ms__fail(MS_ERR_DEVICE, "tensor_wrap_device: device %d: expected MS_DEVICE_CPU or MS_DEVICE_CUDA (a meta "
                        "tensor has no memory to wrap)", (int)device);
    return wrap(__func__, out, data, ndim, shape, dtype, device, device_index);
}

void ms_tensor_retain(ms_tensor *t) {
    if (t) atomic_fetch_add(&t->refcount, 1);
}

void ms_tensor_release(ms_tensor *t) {
    if (t && atomic_fetch_sub(&t->refcount, 1) == 1) {
        storage_release(t->storage);
        free(t);
    }
}

/* ---------------------------------------------------------------- accessors */

/* The accessors below return their documented invalid value for a NULL tensor, with the
 * message set; the core's own callers pass tensors they checked. */

int ms_tensor_ndim(const ms_tensor *t) {
    MS_NOT_NULL_OR(t, -1);
    return t->ndim;
}
int64_t ms_tensor_size(const ms_tensor *t, int dim) {
    MS_NOT_NULL_OR(t, -1);
    return dim >= 0 && dim < t->ndim ? t->shape[dim] : -1;
}
int64_t ms_tensor_stride(const ms_tensor *t, int dim) {
    MS_NOT_NULL_OR(t, -1);
    return dim >= 0 && dim < t->ndim ? t->stride[dim] : -1;
}
static int64_t numel_of(const ms_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}
int64_t ms_tensor_numel(const ms_tensor *t) {
    MS_NOT_NULL_OR(t, -1);
    return numel_of(t);
}
int64_t ms_tensor_nbytes(const ms_tensor *t) {
    MS_NOT_NULL_OR(t, -1);
    return numel_of(t) * ms_dtype_size(t->dtype);
}
ms_dtype ms_tensor_dtype(const ms_tensor *t) {
    MS_NOT_NULL_OR(t, MS_DTYPE_COUNT);
    return t->dtype;
}
ms_device_type ms_tensor_device(const ms_tensor *t) {
    MS_NOT_NULL_OR(t, MS_DEVICE_INVALID);
    return t->storage->device;
}
int ms_tensor_device_index(const ms_tensor *t) {
    MS_NOT_NULL_OR(t, -1);
    return t->storage->device_index;
}

int ms_tensor_is_contiguous(const ms_tensor *t) {
    MS_NOT_NULL_OR(t, 0);
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] == 0) return 1;
        if (t->shape[i] != 1 && t->stride[i] != s) return 0;
        s *= t->shape[i];
    }
    return 1;
}

void *ms_tensor_data(const ms_tensor *t) {
    MS_NOT_NULL_OR(t, NULL);
    if (!t->storage->data || numel_of(t) == 0) return NULL;
    return (char *)t->storage->data + t->offset * ms_dtype_size(t->dtype);
}

/* Byte range [lo, hi) that t's elements span inside its storage. */
static void byte_span(const ms_tensor *t, int64_t *lo, int64_t *hi) {
    int64_t first = t->offset, last = t->offset;
    for (int i = 0; i < t->ndim; i++) last += (t->shape[i] - 1) * t->stride[i];
    int64_t es = ms_dtype_size(t->dtype);
    *lo = first * es;
    *hi = (last + 1) * es;
}

int ms_tensor_overlaps(const ms_tensor *a, const ms_tensor *b) {
    MS_NOT_NULL_OR(a, 0);
    MS_NOT_NULL_OR(b, 0);
    if (numel_of(a) == 0 || numel_of(b) == 0) return 0;
    if (a->storage->data != b->storage->data || !a->storage->data) return 0;
    int64_t alo, ahi, blo, bhi;
    byte_span(a, &alo, &ahi);
    byte_span(b, &blo, &bhi);
    return alo < bhi && blo < ahi;
}

/* ---------------------------------------------------------------- views */

static ms_status view_of(ms_tensor **out, ms_tensor *t) {
    ms_tensor *v = malloc(sizeof *v);
    if (!v) return ms__fail(MS_ERR_OOM, "out of memory allocating a view");
    *v = *t;
    atomic_init(&v->refcount, 1);
    atomic_fetch_add(&t->storage->refcount, 1);
    *out = v;
    return MS_OK;
}

ms_status ms__tensor_bytes(ms_tensor **out, ms_tensor *t) {
    if (!ms_tensor_is_contiguous(t)) return ms__fail(MS_ERR_ARG, "bytes view: the tensor is not contiguous");
    ms_status st = view_of(out, t);
    if (st) return st;
    (*out)->ndim = 1;
    (*out)->shape[0] = ms_tensor_nbytes(t);
    (*out)->stride[0] = 1;
    (*out)->offset = t->offset * (int64_t)ms_dtype_size(t->dtype);
    (*out)->dtype = MS_U8;
    return MS_OK;
}

static ms_status norm_dim(const char *what, int ndim, int *dim) {
    int d = *dim < 0 ? *dim + ndim : *dim;
    if (d < 0 || d >= ndim)
        return ms__fail(MS_ERR_ARG, "%s: dim %d out of range for a %d-dim tensor", what, *dim, ndim);
    *dim = d;
    return MS_OK;
}

ms_status ms_tensor_narrow(ms_tensor **out, ms_tensor *t, int dim, int64_t start, int64_t length) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(t);
    ms_status st = norm_dim("narrow", t->ndim, &dim);
    if (st) return st;
    int64_t n = t->shape[dim];
    if (start < 0 || length < 0 || start > n || length > n - start)
        return ms__fail(MS_ERR_SHAPE,
                        "narrow: start %lld and length %lld do not fit dim %d of size %lld",
                        (long long)start, (long long)length, dim, (long long)n);
    if ((st = view_of(out, t))) return st;
    (*out)->shape[dim] = length;
    if (length > 0) (*out)->offset += start * t->stride[dim];
    return ms__ok();
}

ms_status ms_tensor_view(ms_tensor **out, ms_tensor *t, int ndim, const int64_t *shape) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(t);
    if (ndim > 0) MS_NOT_NULL(shape);
    if (ndim < 0 || ndim > MS_MAX_DIMS)
        return ms__fail(MS_ERR_SHAPE, "view: a tensor has 0 to %d dims, got %d", MS_MAX_DIMS, ndim);
    char a[256], b[256];
    if (!ms_tensor_is_contiguous(t))
        return ms__fail(MS_ERR_SHAPE, "view: the tensor %s is not contiguous (a narrow of a non-leading dim)",
                        ms__shape_str(a, sizeof a, t->ndim, t->shape));
    int64_t resolved[MS_MAX_DIMS], known = 1, numel = ms_tensor_numel(t);
    int infer = -1;
    for (int i = 0; i < ndim; i++) {
        resolved[i] = shape[i];
        if (shape[i] == -1) {
            if (infer >= 0) return ms__fail(MS_ERR_SHAPE, "view: only one size may be -1");
            infer = i;
        } else if (shape[i] < 0) {
            return ms__fail(MS_ERR_SHAPE, "view: size %lld of dim %d is invalid", (long long)shape[i], i);
        } else if (!ms__mul_ok(known, shape[i], &known)) {
            return ms__fail(MS_ERR_OVERFLOW, "view: shape overflows int64");
        }
    }
    if (infer >= 0) {
        if (known == 0 || numel % known)
            return ms__fail(MS_ERR_SHAPE, "view: shape %s does not fit %lld elements",
                            ms__shape_str(a, sizeof a, ndim, shape), (long long)numel);
        resolved[infer] = numel / known;
        known = numel;
    }
    if (known != numel)
        return ms__fail(MS_ERR_SHAPE, "view: shape %s (%lld elements) is not a view of %s (%lld elements)",
                        ms__shape_str(a, sizeof a, ndim, resolved), (long long)known,
                        ms__shape_str(b, sizeof b, t->ndim, t->shape), (long long)numel);
    ms_status st = view_of(out, t);
    if (st) return st;
    (*out)->ndim = ndim;
    if (ndim) memcpy((*out)->shape, resolved, (size_t)ndim * sizeof *resolved);
    contiguous_strides(ndim, resolved, (*out)->stride);
    return ms__ok();
}

ms_status ms_tensor_chunk(ms_tensor **out, ms_tensor *t, int64_t chunks, int64_t index, int dim) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(t);
    ms_status st = norm_dim("chunk", t->ndim, &dim);
    if (st) return st;
    int64_t len, off;
    if ((st = ms_chunk_extent(t->shape[dim], chunks, index, &len, &off))) return ms__wrap(st, "chunk");
    return ms_tensor_narrow(out, t, dim, off, len);
}

/* ---------------------------------------------------------------- copy and fill */

/* Calls fn on every maximal run of elements that is contiguous in both a and b (same
 * shape), in row-major order.  b may be NULL.  Offsets are in elements. */
typedef void (*run_fn)(void *ctx, int64_t off_a, int64_t off_b, int64_t n);

static void for_each_run(const ms_tensor *a, const ms_tensor *b, run_fn fn, void *ctx) {
    int nd = a->ndim;
    int64_t numel = ms_tensor_numel(a);
    if (numel == 0) return;
    /* inner = number of trailing dims that are contiguous in both tensors */
    int64_t run = 1, expect = 1;
    int inner = nd;
    while (inner > 0) {
        int d = inner - 1;
        bool ok = a->shape[d] == 1 ||
                  (a->stride[d] == expect && (!b || b->stride[d] == expect));
        if (!ok) break;
        run *= a->shape[d];
        expect *= a->shape[d];
        inner--;
    }
    int64_t idx[MS_MAX_DIMS] = {0};
    for (int64_t done = 0; done < numel; done += run) {
        int64_t oa = a->offset, ob = b ? b->offset : 0;
        for (int d = 0; d < inner; d++) {
            oa += idx[d] * a->stride[d];
            if (b) ob += idx[d] * b->stride[d];
        }
        fn(ctx, oa, ob, run);
        for (int d = inner - 1; d >= 0; d--) {
            if (++idx[d] < a->shape[d]) break;
            idx[d] = 0;
        }
    }
}

typedef struct { const ms_tensor *dst, *src; ms_status st; } copy_ctx;

static void copy_run(void *p, int64_t od, int64_t os, int64_t n) {
    copy_ctx *c = p;
    char *d = (char *)c->dst->storage->data + od * ms_dtype_size(c->dst->dtype);
    const char *s = (const char *)c->src->storage->data + os * ms_dtype_size(c->src->dtype);
    if (c->dst->storage->device != MS_DEVICE_CUDA) ms__cast_contig(d, c->dst->dtype, s, c->src->dtype, n);
    else if (!c->st) c->st = ms__cuda_cast(c->dst->storage->device_index, d, c->dst->dtype, s, c->src->dtype, n);
}

/* "cpu", "meta", "cuda:1" */
static const char *device_str(char *buf, size_t cap, const ms_tensor *t) {
    static const char *const names[] = {[MS_DEVICE_CPU] = "cpu", [MS_DEVICE_META] = "meta", [MS_DEVICE_CUDA] = "cuda"};
    if (t->storage->device == MS_DEVICE_CUDA) snprintf(buf, cap, "cuda:%d", t->storage->device_index);
    else snprintf(buf, cap, "%s", names[t->storage->device]);
    return buf;
}

static bool same_device(const ms_tensor *a, const ms_tensor *b) {
    return a->storage->device == b->storage->device && a->storage->device_index == b->storage->device_index;
}

/* dst <- src on another device: src's bytes, made contiguous on its own device, cross in
 * one memcpy; the cast and the strided placement, if any, happen on dst's side. */
static ms_status copy_across(ms_tensor *dst, const ms_tensor *src) {
    ms_tensor *s = NULL, *m = NULL;
    ms_status st = MS_OK;
    const int device = dst->storage->device == MS_DEVICE_CUDA ? dst->storage->device_index : src->storage->device_index;
    if (ms_tensor_is_contiguous(src)) ms_tensor_retain(s = (ms_tensor *)src);
    else if ((st = ms_tensor_to(&s, src, src->dtype))) return st;
    if (dst->dtype == src->dtype && ms_tensor_is_contiguous(dst)) {
        st = ms__cuda_memcpy(device, ms_tensor_data(dst), ms_tensor_data(s), ms_tensor_nbytes(s));
    } else {
        st = ms_tensor_new(&m, src->ndim, src->shape, src->dtype, dst->storage->device, dst->storage->device_index);
        if (!st) st = ms__cuda_memcpy(device, ms_tensor_data(m), ms_tensor_data(s), ms_tensor_nbytes(s));
        if (!st) st = ms_tensor_copy(dst, m);
    }
    ms_tensor_release(s);
    ms_tensor_release(m);
    return st ? st : ms__ok();
}

static bool same_shape(const ms_tensor *a, const ms_tensor *b) {
    if (a->ndim != b->ndim) return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return false;
    return true;
}

ms_status ms_tensor_copy(ms_tensor *dst, const ms_tensor *src) {
    MS_NOT_NULL(dst);
    MS_NOT_NULL(src);
    if (!same_shape(dst, src)) {
        char a[256], b[256];
        return ms__fail(MS_ERR_SHAPE, "copy: destination shape %s differs from source shape %s",
                        ms__shape_str(a, sizeof a, dst->ndim, dst->shape),
                        ms__shape_str(b, sizeof b, src->ndim, src->shape));
    }
    ms_device_type dd = dst->storage->device, sd = src->storage->device;
    if ((dd == MS_DEVICE_META) != (sd == MS_DEVICE_META)) {
        char a[32], b[32];
        return ms__fail(MS_ERR_DEVICE, "copy: from a %s tensor to a %s tensor: a meta tensor holds no data",
                        device_str(a, sizeof a, src), device_str(b, sizeof b, dst));
    }
    if (dd == MS_DEVICE_META || ms_tensor_numel(dst) == 0) return ms__ok();
    if (!same_device(dst, src)) return copy_across(dst, src);
    if (dst->storage == src->storage && dst->offset == src->offset && dst->dtype == src->dtype &&
        !memcmp(dst->stride, src->stride, sizeof dst->stride))
        return ms__ok(); /* copy onto itself */
    if (ms_tensor_overlaps(dst, src)) {
        /* Overlapping views: go through a private copy of the source. */
        ms_tensor *tmp;
        ms_status st = ms_tensor_to(&tmp, src, src->dtype);
        if (st) return st;
        st = ms_tensor_copy(dst, tmp);
        ms_tensor_release(tmp);
        return st;
    }
    copy_ctx c = {dst, src, MS_OK};
    for_each_run(dst, src, copy_run, &c);
    if (!c.st && dd == MS_DEVICE_CUDA) c.st = ms__cuda_sync(dst->storage->device_index); /* the runs, enqueued */
    return c.st ? ms__wrap(c.st, "copy") : ms__ok();
}

typedef struct { const ms_tensor *t; unsigned char value[8]; ms_status st; } fill_ctx;

static void fill_run(void *p, int64_t off, int64_t unused, int64_t n) {
    (void)unused;
    fill_ctx *c = p;
    size_t es = (size_t)ms_dtype_size(c->t->dtype);
    char *d = (char *)c->t->storage->data + off * (int64_t)es;
    if (c->t->storage->device == MS_DEVICE_CUDA) {
        if (!c->st) c->st = ms__cuda_fill(c->t->storage->device_index, d, n, c->value, (int)es);
        return;
    }
    bool zero = true;
    for (size_t i = 0; i < es; i++) zero &= c->value[i] == 0;
    if (zero) {
        memset(d, 0, (size_t)n * es);
        return;
    }
    /* Doubling copies: log2(n) memcpy calls instead of n small ones. */
    memcpy(d, c->value, es);
    size_t have = es, total = (size_t)n * es;
    while (have < total) {
        size_t k = have < total - have ? have : total - have;
        memcpy(d + have, d, k);
        have += k;
    }
}

/* Every element of t set to the scalar at value, of dtype vt (f64 or i64). */
static ms_status fill_scalar(ms_tensor *t, const void *value, ms_dtype vt) {
    if (t->storage->device == MS_DEVICE_META || ms_tensor_numel(t) == 0) return ms__ok();
    fill_ctx c = {.t = t};
    ms__cast_contig(c.value, t->dtype, value, vt, 1);
    for_each_run(t, NULL, fill_run, &c);
    if (!c.st && t->storage->device == MS_DEVICE_CUDA) c.st = ms__cuda_sync(t->storage->device_index);
    return c.st ? ms__wrap(c.st, "fill") : ms__ok();
}

ms_status ms_tensor_fill(ms_tensor *t, double value) {
    MS_NOT_NULL(t);
    return fill_scalar(t, &value, MS_F64);
}

ms_status ms_tensor_fill_int(ms_tensor *t, int64_t value) {
    MS_NOT_NULL(t);
    return fill_scalar(t, &value, MS_I64);
}

ms_status ms_tensor_to(ms_tensor **out, const ms_tensor *t, ms_dtype dtype) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(t);
    ms_tensor *r;
    ms_status st = ms_tensor_new(&r, t->ndim, t->shape, dtype, t->storage->device, t->storage->device_index);
    if (st) return st;
    if ((st = ms_tensor_copy(r, t))) {
        ms_tensor_release(r);
        return st;
    }
    *out = r;
    return ms__ok();
}

ms_status ms_tensor_to_device(ms_tensor **out, const ms_tensor *t, ms_device_type device, int device_index) {
    MS_NOT_NULL(out);
    MS_NOT_NULL(t);
    ms_tensor *r;
    ms_status st = ms_tensor_new(&r, t->ndim, t->shape, t->dtype, device, device_index);
    if (st) return st;
    if ((st = ms_tensor_copy(r, t))) {
        ms_tensor_release(r);
        return st;
    }
    *out = r;
    return ms__ok();
}
