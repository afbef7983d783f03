/*
 * reduce.c: the element-wise reductions every backend shares, so that they round alike:
 * blocks of MS_REDUCE_BLOCK elements accumulated in rank order 0..n-1, in f32 for the
 * 8- and 16-bit floats (rounded once), with an AVX2 build of the loops chosen at run time.
 */
#include "comm.h"

#include <string.h>

enum { MS_BLOCK = MS_REDUCE_BLOCK };


/* The two kernels of one accumulation type, over m elements that never overlap:
 *   first: out[i] = x[i] op y[i]      (the first two sources of a block)
 *   next:  acc[i] = acc[i] op x[i]    (every further source) */
typedef struct kernels {
    void (*first)(void *out, const void *x, const void *y, int64_t m, ms_op op);
    void (*next)(void *acc, const void *x, int64_t m, ms_op op);
} kernels;

/* out[i] = x[i] op y[i] for each op: sums wrap through the unsigned type UT for integers;
 * max and min propagate NaN from either side. */
#define MS_OP_LOOPS(T, UT, IS_NAN, out, x, y)                                                  \
    switch (op) {                                                                              \
    case MS_OP_SUM:                                                                            \
    case MS_OP_AVG:                                                                            \
        for (int64_t i = 0; i < m; i++) out[i] = (T)((UT)x[i] + (UT)y[i]);                     \
        break;                                                                                 \
    case MS_OP_MAX:                                                                            \
        for (int64_t i = 0; i < m; i++) out[i] = y[i] > x[i] || IS_NAN(y[i]) ? y[i] : x[i];    \
        break;                                                                                 \
    case MS_OP_MIN:                                                                            \
        for (int64_t i = 0; i < m; i++) out[i] = y[i] < x[i] || IS_NAN(y[i]) ? y[i] : x[i];    \
        break;                                                                                 \
    }
#define MS_FLOAT_NAN(v) ((v) != (v))
#define MS_INT_NAN(v) 0

/* name_first and name_next for type T, compiled with ATTR (an instruction set or nothing). */
#define MS_KERNELS(name, T, UT, IS_NAN, ATTR)                                                  \
    ATTR static void name##_first(void *out_, const void *x_, const void *y_, int64_t m, ms_op op) { \
        T *restrict out = out_;                                                                \
        const T *restrict x = x_, *restrict y = y_;                                            \
        MS_OP_LOOPS(T, UT, IS_NAN, out, x, y)                                                  \
    }                                                                                          \
    ATTR static void name##_next(void *acc_, const void *x_, int64_t m, ms_op op) {            \
        T *restrict acc = acc_;                                                                \
        const T *restrict x = x_;                                                              \
        MS_OP_LOOPS(T, UT, IS_NAN, acc, acc, x)                                                \
    }

/* The kernels of every accumulation type, k<type><SUFFIX>_first/_next, and their table
 * kernels<SUFFIX>[dtype] (bool reduces as u8). */
#define MS_KERNEL_SET(SUFFIX, ATTR)                                                            \
    MS_KERNELS(kf32##SUFFIX, float, float, MS_FLOAT_NAN, ATTR)                                 \
    MS_KERNELS(kf64##SUFFIX, double, double, MS_FLOAT_NAN, ATTR)                               \
    MS_KERNELS(ki64##SUFFIX, int64_t, uint64_t, MS_INT_NAN, ATTR)                              \
    MS_KERNELS(ki32##SUFFIX, int32_t, uint32_t, MS_INT_NAN, ATTR)                              \
    MS_KERNELS(ki8##SUFFIX, int8_t, uint8_t, MS_INT_NAN, ATTR)                                 \
    MS_KERNELS(ku8##SUFFIX, uint8_t, uint8_t, MS_INT_NAN, ATTR)                                \
    static const kernels kernels##SUFFIX[MS_DTYPE_COUNT] = {                                   \
        [MS_F32] = {kf32##SUFFIX##_first, kf32##SUFFIX##_next},                                \
        [MS_F64] = {kf64##SUFFIX##_first, kf64##SUFFIX##_next},                                \
        [MS_I64] = {ki64##SUFFIX##_first, ki64##SUFFIX##_next},                                \
        [MS_I32] = {ki32##SUFFIX##_first, ki32##SUFFIX##_next},                                \
        [MS_I8] = {ki8##SUFFIX##_first, ki8##SUFFIX##_next},                                   \
        [MS_U8] = {ku8##SUFFIX##_first, ku8##SUFFIX##_next},                                   \
        [MS_BOOL] = {ku8##SUFFIX##_first, ku8##SUFFIX##_next}};

MS_KERNEL_SET(_portable, )
#if defined(__x86_64__) && defined(__GNUC__)
/* AVX2 builds of the same loops, chosen at run time (no global -mavx2, no ifunc). */
MS_KERNEL_SET(_avx2, __attribute__((target("avx2"))))
#endif

/* The kernels for accumulation dtype `at` on this CPU. */
static const kernels *kernels_for(ms_dtype at) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2")) return &kernels_avx2[at];
#endif
    return &kernels_portable[at];
}

/* The dtype a reduction accumulates in: f32 for the floats narrower than f32. */
static ms_dtype acc_dtype(ms_dtype d) {
    switch (d) {
    case MS_F16:
    case MS_BF16:
    case MS_F8E4M3:
    case MS_F8E5M2: return MS_F32;
    default: return d;
    }
}

/* avg: acc /= n in the accumulation type (f32 or f64). */
static void divide(ms_dtype at, void *acc, int64_t m, int n) {
    if (at == MS_F64) {
        double *a = acc;
        for (int64_t i = 0; i < m; i++) a[i] /= (double)n;
    } else {
        float *a = acc;
        for (int64_t i = 0; i < m; i++) a[i] /= (float)n;
    }
}

/* x itself when the accumulation dtype is the dtype, else x widened into buf. */
static const void *widen(void *buf, ms_dtype at, const void *x, ms_dtype dtype, int64_t m) {
    if (at == dtype) return x;
    ms__cast_contig(buf, at, x, dtype, m);
    return buf;
}

/* dsts[d][i] = srcs[0][i] op srcs[1][i] op ... op srcs[n-1][i] for i < count and every d
 * (ndst of them).  Each block is accumulated straight in the destination when there is one
 * that is not also a source and no widening is needed (the out-of-place reduce_scatter: no
 * extra pass over the data), else in a stack block that is read from every source before
 * any destination is written (in-place reduce_scatter, all_reduce, 8- and 16-bit floats). */
void ms__reduce(ms_dtype dtype, ms_op op, int n, const void *const *srcs, void *const *dsts, int ndst,
                int64_t count) {
    const ms_dtype at = acc_dtype(dtype);
    const kernels *k = kernels_for(at);
    const size_t es = (size_t)ms_dtype_size(dtype), as = (size_t)ms_dtype_size(at);
    bool direct = ndst == 1 && at == dtype;
    for (int j = 0; j < n; j++) direct &= srcs[j] != dsts[0];
    _Alignas(64) unsigned char acc[MS_BLOCK * sizeof(double)];   /* (m) of at, unless direct */
    _Alignas(64) unsigned char wide[2][MS_BLOCK * sizeof(float)]; /* (2, m) f32 from narrow floats */
    for (int64_t off = 0; off < count; off += MS_BLOCK) {
        const int64_t m = count - off < MS_BLOCK ? count - off : MS_BLOCK;
        const size_t boff = (size_t)off * es;
        char *d0 = (char *)dsts[0] + boff;
        void *a = direct ? (void *)d0 : (void *)acc;
        const void *x = widen(wide[0], at, (const char *)srcs[0] + boff, dtype, m);
        if (n == 1) memcpy(a, x, (size_t)m * as);
        else k->first(a, x, widen(wide[1], at, (const char *)srcs[1] + boff, dtype, m), m, op);
        for (int j = 2; j < n; j++) k->next(a, widen(wide[1], at, (const char *)srcs[j] + boff, dtype, m), m, op);
        if (op == MS_OP_AVG) divide(at, a, m, n);
        if (direct) continue;
        if (at == dtype) memcpy(d0, acc, (size_t)m * es);
        else ms__cast_contig(d0, dtype, acc, at, m);
        for (int d = 1; d < ndst; d++) memcpy((char *)dsts[d] + boff, d0, (size_t)m * es);
    }
}

