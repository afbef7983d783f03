/*
 * ms_internal.h: what the core's files share and the public header does not show.
 * Never included by the Lua binding or by hosts.
 */
#ifndef MS_INTERNAL_H
#define MS_INTERNAL_H

#include "moonshard.h"

#include <stdatomic.h>
#include <stdbool.h>

#if defined(__GNUC__)
#define MS_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define MS_PRINTF(a, b)
#endif

/* ---------------------------------------------------------------- status.c */

/* Records "fmt ..." as this thread's message and returns st. */
ms_status ms__fail(ms_status st, const char *fmt, ...) MS_PRINTF(2, 3);
/* Clears the message and returns MS_OK. */
ms_status ms__ok(void);
/* Prepends "prefix: " to this thread's message, keeps st. */
ms_status ms__wrap(ms_status st, const char *fmt, ...) MS_PRINTF(2, 3);
/* Records "fn: arg is NULL" as this thread's message and returns MS_ERR_ARG. */
ms_status ms__null_arg(const char *fn, const char *arg);

/* The NULL checks of the public functions (moonshard.h: every handle and pointer argument
 * is checked).  The message names the public function (__func__: use them in the function
 * itself, not in a helper it calls) and the argument as the header names it:
 * "ms_tensor_copy: dst is NULL".  MS_NOT_NULL returns MS_ERR_ARG; MS_NOT_NULL_OR returns
 * `bad`, the documented value of an accessor that cannot fail otherwise. */
#define MS_NOT_NULL(p)                                       \
    do {                                                     \
        if (!(p)) return ms__null_arg(__func__, #p);         \
    } while (0)
#define MS_NOT_NULL_OR(p, bad)                               \
    do {                                                     \
        if (!(p)) {                                          \
            ms__null_arg(__func__, #p);                      \
            return bad;                                      \
        }                                                    \
    } while (0)

/* a*b and a+b with overflow checks: false on overflow. */
bool ms__mul_ok(int64_t a, int64_t b, int64_t *out);
bool ms__add_ok(int64_t a, int64_t b, int64_t *out);
/* "[2, 3, 4]" into buf (always terminated). */
const char *ms__shape_str(char *buf, size_t cap, int ndim, const int64_t *shape);

/* ---------------------------------------------------------------- dtype.c */

/* X(enum, name, size, is_float): the one list of dtypes. */
#define MS_DTYPE_LIST(X)              \
    X(MS_F32, "f32", 4, 1)            \
    X(MS_F16, "f16", 2, 1)            \
    X(MS_BF16, "bf16", 2, 1)          \
    X(MS_F8E4M3, "f8e4m3", 1, 1)      \
    X(MS_F8E5M2, "f8e5m2", 1, 1)      \
    X(MS_F64, "f64", 8, 1)            \
    X(MS_I64, "i64", 8, 0)            \
    X(MS_I32, "i32", 4, 0)            \
    X(MS_I8, "i8", 1, 0)              \
    X(MS_U8, "u8", 1, 0)              \
    X(MS_BOOL, "bool", 1, 0)

static inline bool ms__dtype_valid(ms_dtype d) { return (unsigned)d < (unsigned)MS_DTYPE_COUNT; }

/* ---------------------------------------------------------------- cast.c */

/* Scalar conversions, portable, exactly the rules of ms_cast. */
uint16_t ms__f32_to_bf16(float f);
float ms__bf16_to_f32(uint16_t h);
uint16_t ms__f32_to_f16(float f);
float ms__f16_to_f32(uint16_t h);
uint8_t ms__f32_to_e4m3(float f);
float ms__e4m3_to_f32(uint8_t b);
uint8_t ms__f32_to_e5m2(float f);
float ms__e5m2_to_f32(uint8_t b);

/* ms_cast without argument checks (n >= 0, valid dtypes, no overlap). */
void ms__cast_contig(void *dst, ms_dtype dst_dtype, const void *src, ms_dtype src_dtype, int64_t n);

/* ---------------------------------------------------------------- tensor.c */

/* An allocation account: the bytes of memory allocated (calloc, cudaMalloc) for the storages
 * made while it was this thread's account (ms__account_enter), by category, taken off when
 * such a storage is freed, on whichever thread.  Counted at the allocator, apart from any
 * caller's own books: the shard units keep one per rank (unit_cache.c) so that a test can
 * hold their books and the planner to the memory really allocated (ms_unit_rank_allocated).
 * Refcounted: a storage retains the account it was counted in. */
enum { MS__ACCOUNT_CATS = 4 };
typedef struct ms__account {
    atomic_int refcount;
    _Atomic int64_t bytes[MS__ACCOUNT_CATS];
} ms__account;

/* A new account (refcount 1, zero bytes), or NULL when out of memory. */
ms__account *ms__account_new(void);
void ms__account_release(ms__account *a);
/* Makes (a, cat) this thread's account until ms__account_leave (a NULL account counts
 * nothing); nests. */
typedef struct ms__account_scope {
    ms__account *account;
    int cat;
} ms__account_scope;
ms__account_scope ms__account_enter(ms__account *a, int cat);
void ms__account_leave(ms__account_scope previous);

typedef struct ms_storage {
    atomic_int refcount;
    void *data;      /* NULL for meta */
    int64_t nbytes;
    bool owned;      /* false for ms_tensor_wrap */
    ms_device_type device;
    int device_index;
    ms__account *account; /* retained: where this storage's allocation was counted, else NULL */
    int account_cat;
} ms_storage;

struct ms_tensor {
    atomic_int refcount;
    ms_storage *storage;  /* retained */
    int64_t offset;       /* first element, in elements from storage->data */
    int ndim;
    int64_t shape[MS_MAX_DIMS];
    int64_t stride[MS_MAX_DIMS]; /* elements */
    ms_dtype dtype;
};

/* *out = a 1-D u8 view of the bytes of a contiguous tensor (same storage). */
ms_status ms__tensor_bytes(ms_tensor **out, ms_tensor *t);

/* Checks a shape (0..8 dims, sizes >= 0) and returns its numel through *numel. */
ms_status ms__check_shape(int ndim, const int64_t *shape, int64_t *numel);

#endif /* MS_INTERNAL_H */
