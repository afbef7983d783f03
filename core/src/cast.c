/*
 * cast.c: ms_cast, dtype conversion of contiguous buffers, with a portable C path and an
 * AVX2 + F16C path chosen at run time that give identical bits for every input.  The rules
 * (the contract) are stated above ms_cast; the scalar functions that implement them are in
 * cast_scalar.h, shared with the CUDA kernels.
 */
#include "ms_internal.h"

#include <string.h>

/* The kernel signature: n elements from src to dst.  `stream` is a hint that dst is too
 * large to be read again soon, so stores may bypass the cache. */
typedef void (*cast_fn)(void *dst, const void *src, int64_t n, bool stream);

/* Outputs from this many bytes up are written with non-temporal stores by the AVX2
 * kernels, which saves reading each destination line before writing it over.  Below it
 * the output likely stays in cache for whoever reads it next. */
enum { MS_STREAM_BYTES = 8 << 20 };
/* Stack block for pairs that pass through a hub type: 8 KiB stays in L1. */
enum { MS_STAGE_BYTES = 8 << 10 };

#include "cast_scalar.h"

/* The exported scalars (ms_internal.h); the kernels below use the inline versions, which a
 * shared library's exported functions could not be inlined as. */
uint16_t ms__f32_to_bf16(float f) { return f32_to_bf16(f); }
float ms__bf16_to_f32(uint16_t h) { return bf16_to_f32(h); }
uint16_t ms__f32_to_f16(float f) { return f32_to_f16(f); }
float ms__f16_to_f32(uint16_t h) { return f16_to_f32(h); }
uint8_t ms__f32_to_e4m3(float f) { return f32_to_e4m3(f); }
float ms__e4m3_to_f32(uint8_t b) { return e4m3_to_f32(b); }
uint8_t ms__f32_to_e5m2(float f) { return f32_to_e5m2(f); }
float ms__e5m2_to_f32(uint8_t b) { return e5m2_to_f32(b); }

/* ---------------------------------------------------------------- portable kernels */

/* One element-wise kernel: x is a source element of type S, expr its value as D.  Byte
 * pointers and memcpy let the caller's pointers have any alignment (memcpy of a scalar
 * compiles to a plain move). */
#define CAST_LOOP(name, S, D, expr)                                           \
    static void name(void *dst, const void *src, int64_t n, bool stream) {     \
        (void)stream;                                                          \
        const unsigned char *s = src;                                          \
        unsigned char *d = dst;                                                \
        for (int64_t i = 0; i < n; i++) {                                      \
            S x;                                                               \
            memcpy(&x, s + i * (int64_t)sizeof(S), sizeof x);                  \
            D y = (D)(expr);                                                   \
            memcpy(d + i * (int64_t)sizeof(D), &y, sizeof y);                  \
        }                                                                      \
    }

CAST_LOOP(port_bf16_to_f32, uint16_t, float, bf16_to_f32(x))
CAST_LOOP(port_f32_to_bf16, float, uint16_t, f32_to_bf16(x))
CAST_LOOP(port_f16_to_f32, uint16_t, float, f16_to_f32(x))
CAST_LOOP(port_f32_to_f16, float, uint16_t, f32_to_f16(x))
CAST_LOOP(port_e4m3_to_f32, uint8_t, float, e4m3_to_f32(x))
CAST_LOOP(port_f32_to_e4m3, float, uint8_t, f32_to_e4m3(x))
CAST_LOOP(port_e5m2_to_f32, uint8_t, float, e5m2_to_f32(x))
CAST_LOOP(port_f32_to_e5m2, float, uint8_t, f32_to_e5m2(x))
CAST_LOOP(f64_to_f32_k, double, float, f64_to_f32(x))
CAST_LOOP(f32_to_f64_k, float, double, f32_to_f64(x))
CAST_LOOP(bool_to_f32, uint8_t, float, x != 0)
CAST_LOOP(f32_to_bool, float, uint8_t, x != 0)
CAST_LOOP(f64_to_bool, double, uint8_t, x != 0)
CAST_LOOP(bool_to_i64, uint8_t, int64_t, x != 0)
CAST_LOOP(i64_to_bool, int64_t, uint8_t, x != 0)
CAST_LOOP(i64_to_f64, int64_t, double, x)

/* X(name, C type, lo, hi): the integer dtypes.  Each gets its kernels to and from the f32
 * and f64 hubs; those narrower than int64 also to and from the int64 hub (C casts wrap). */
#define NARROW_INT_LIST(X)                \
    X(i32, int32_t, INT32_MIN, INT32_MAX) \
    X(i8, int8_t, INT8_MIN, INT8_MAX)     \
    X(u8, uint8_t, 0, UINT8_MAX)
#define INT_LIST(X) X(i64, int64_t, INT64_MIN, INT64_MAX) NARROW_INT_LIST(X)

#define FLOAT_HUB_KERNELS(name, T, lo, hi)                  \
    CAST_LOOP(name##_to_f32, T, float, x)                    \
    CAST_LOOP(f32_to_##name, float, T, sat_trunc(x, lo, hi)) \
    CAST_LOOP(f64_to_##name, double, T, sat_trunc(x, lo, hi))
#define INT_HUB_KERNELS(name, T, lo, hi)     \
    CAST_LOOP(name##_to_i64, T, int64_t, x)  \
    CAST_LOOP(i64_to_##name, int64_t, T, x)
INT_LIST(FLOAT_HUB_KERNELS)
NARROW_INT_LIST(INT_HUB_KERNELS)

/* ---------------------------------------------------------------- AVX2 + F16C kernels */

/* The AVX2 path replaces the eight kernels between f32 and bf16, f16, e4m3, e5m2; every
 * other pair reuses them through the f32 hub, and the integer kernels are shared.  Both
 * paths compute the same formulas (f16 by the F16C instructions, which the portable code
 * matches), so they agree bit for bit; test_cast checks it on every f32. */

#if defined(__x86_64__) && defined(__GNUC__)
#define MS_CAST_HAVE_AVX2 1
#include <cpuid.h>
#include <immintrin.h>

/* Only these functions use AVX2; the dispatch checks exactly avx2 and f16c. */
#define MS_AVX2 __attribute__((target("avx2,f16c")))
#define MS_AVX2_INLINE static inline __attribute__((always_inline, target("avx2,f16c")))

MS_AVX2_INLINE __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
MS_AVX2_INLINE __m128i load128(const void *p) { return _mm_loadu_si128((const __m128i *)p); }
MS_AVX2_INLINE __m256i set8(uint32_t v) { return _mm256_set1_epi32((int)v); }

MS_AVX2_INLINE void store256(void *p, __m256i v, bool stream) {
    if (stream) _mm256_stream_si256((__m256i *)p, v);
    else _mm256_storeu_si256((__m256i *)p, v);
}

/* round_narrow on 8 lanes: both branches computed, the normal one picked by a compare. */
MS_AVX2_INLINE __m256i round_narrow8(__m256i a, uint32_t bias, uint32_t mbits) {
    const int shift = (int)(23 - mbits);
    __m256i r = _mm256_sub_epi32(a, set8((127 - bias) << 23));
    __m256i normal = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(r, set8((1u << (shift - 1)) - 1)),
                         _mm256_and_si256(_mm256_srli_epi32(r, shift), set8(1))),
        shift);
    __m256 magic = _mm256_castsi256_ps(set8((151 - bias - mbits) << 23));
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), magic)),
                                   _mm256_castps_si256(magic));
    __m256i is_normal = _mm256_cmpgt_epi32(a, set8(((128 - bias) << 23) - 1));
    return _mm256_blendv_epi8(sub, normal, is_normal);
}

/* 8 f32 -> 8 lanes holding bf16 bits, as f32_to_bf16 for every lane that is not NaN. */
MS_AVX2_INLINE __m256i bf16_round8(__m256i u) {
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), set8(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, set8(0x7FFF)), lsb), 16);
}

/* 8 f32 -> 8 lanes holding fp8 bits, as f32_to_fp8 for every lane that is not NaN. */
MS_AVX2_INLINE __m256i fp8_round8(__m256i u, uint32_t bias, uint32_t mbits, uint32_t maxcode) {
    __m256i a = _mm256_and_si256(u, set8(0x7FFFFFFF));
    __m256i code = _mm256_min_epu32(round_narrow8(a, bias, mbits), set8(maxcode));
    return _mm256_or_si256(code, _mm256_slli_epi32(_mm256_srli_epi32(u, 31), 7));
}

/* All ones in the lanes of u that hold a NaN. */
MS_AVX2_INLINE __m256i nan_lanes8(__m256i u) {
    __m256 f = _mm256_castsi256_ps(u);
    return _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
}

/* Whether any of the 32 f32 in u[0..3] is NaN: one unordered compare looks at two vectors.
 * NaNs are rare and blending them in costs a third of a narrowing step, so the steps blend
 * only when this says so. */
MS_AVX2_INLINE bool any_nan32(const __m256i u[4]) {
    __m256 a = _mm256_cmp_ps(_mm256_castsi256_ps(u[0]), _mm256_castsi256_ps(u[1]), _CMP_UNORD_Q);
    __m256 b = _mm256_cmp_ps(_mm256_castsi256_ps(u[2]), _mm256_castsi256_ps(u[3]), _CMP_UNORD_Q);
    __m256 any = _mm256_or_ps(a, b);
    return !_mm256_testz_ps(any, any);
}

/* Lanes of a and b (16-bit values) -> 16 u16 in order; packus interleaves 128-bit halves. */
MS_AVX2_INLINE __m256i pack16(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
}

/* Lanes of a, b, c, d (8-bit values) -> 32 bytes in order. */
MS_AVX2_INLINE __m256i pack8(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* 16 f16 values -> 16 f32 at p (64 bytes), each multiplied by `scale` (exact: a power of
 * two that keeps every value normal; NaNs pass through unchanged). */
MS_AVX2_INLINE void store_f16x16(unsigned char *p, __m256i h, float scale, bool stream) {
    __m256 k = _mm256_set1_ps(scale);
    __m256 lo = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), k);
    __m256 hi = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), k);
    store256(p, _mm256_castps_si256(lo), stream);
    store256(p + 32, _mm256_castps_si256(hi), stream);
}

/* The steps: 32 elements each, s and d at any alignment (d 32-byte aligned when streaming). */

MS_AVX2_INLINE void step_f32_to_bf16(unsigned char *d, const unsigned char *s, bool stream) {
    __m256i u[4], r[4];
    for (int k = 0; k < 4; k++) r[k] = bf16_round8(u[k] = load256(s + 32 * k));
    if (any_nan32(u)) /* the NaN rule: (u >> 16) | 0x0040 */
        for (int k = 0; k < 4; k++)
            r[k] = _mm256_blendv_epi8(r[k], _mm256_or_si256(_mm256_srli_epi32(u[k], 16), set8(0x0040)),
                                      nan_lanes8(u[k]));
    store256(d, pack16(r[0], r[1]), stream);
    store256(d + 32, pack16(r[2], r[3]), stream);
}

MS_AVX2_INLINE void step_bf16_to_f32(unsigned char *d, const unsigned char *s, bool stream) {
    for (int k = 0; k < 4; k++)
        store256(d + 32 * k, _mm256_slli_epi32(_mm256_cvtepu16_epi32(load128(s + 16 * k)), 16), stream);
}

MS_AVX2_INLINE void step_f32_to_f16(unsigned char *d, const unsigned char *s, bool stream) {
    for (int k = 0; k < 2; k++) {
        __m128i lo = _mm256_cvtps_ph(_mm256_castsi256_ps(load256(s + 64 * k)), _MM_FROUND_TO_NEAREST_INT);
        __m128i hi = _mm256_cvtps_ph(_mm256_castsi256_ps(load256(s + 64 * k + 32)), _MM_FROUND_TO_NEAREST_INT);
        store256(d + 32 * k, _mm256_set_m128i(hi, lo), stream);
    }
}

MS_AVX2_INLINE void step_f16_to_f32(unsigned char *d, const unsigned char *s, bool stream) {
    for (int k = 0; k < 2; k++) store_f16x16(d + 64 * k, load256(s + 32 * k), 1.0f, stream);
}

MS_AVX2_INLINE void step_f32_to_fp8(unsigned char *d, const unsigned char *s, bool stream,
                                    uint32_t bias, uint32_t mbits, uint32_t maxcode, uint32_t nancode) {
    __m256i u[4], r[4];
    for (int k = 0; k < 4; k++) r[k] = fp8_round8(u[k] = load256(s + 32 * k), bias, mbits, maxcode);
    if (any_nan32(u)) /* the NaN rule: sign | nancode */
        for (int k = 0; k < 4; k++)
            r[k] = _mm256_blendv_epi8(r[k], _mm256_or_si256(_mm256_and_si256(r[k], set8(0x80)), set8(nancode)),
                                      nan_lanes8(u[k]));
    store256(d, pack8(r[0], r[1], r[2], r[3]), stream);
}

MS_AVX2_INLINE void step_f32_to_e4m3(unsigned char *d, const unsigned char *s, bool stream) {
    step_f32_to_fp8(d, s, stream, 7, 3, 0x7E, 0x7F);
}

MS_AVX2_INLINE void step_f32_to_e5m2(unsigned char *d, const unsigned char *s, bool stream) {
    step_f32_to_fp8(d, s, stream, 15, 2, 0x7B, 0x7E);
}

/* e4m3 bits b -> f16 bits whose value times 2^8 is b's: the 7 magnitude bits shifted into
 * an f16's exponent and mantissa fields differ only by the bias (15 - 7 = 8), subnormals
 * included (e4m3 subnormals are f16 subnormals then).  NaN -> the f16 quiet NaN. */
MS_AVX2_INLINE void step_e4m3_to_f32(unsigned char *d, const unsigned char *s, bool stream) {
    for (int k = 0; k < 2; k++) {
        __m256i b = _mm256_cvtepu8_epi16(load128(s + 16 * k));
        __m256i mag = _mm256_and_si256(b, _mm256_set1_epi16(0x7F));
        __m256i h = _mm256_blendv_epi8(_mm256_slli_epi16(mag, 7), _mm256_set1_epi16(0x7E00),
                                       _mm256_cmpeq_epi16(mag, _mm256_set1_epi16(0x7F)));
        h = _mm256_or_si256(h, _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
        store_f16x16(d + 64 * k, h, 256.0f, stream);
    }
}

MS_AVX2_INLINE void step_e5m2_to_f32(unsigned char *d, const unsigned char *s, bool stream) {
    for (int k = 0; k < 2; k++)
        store_f16x16(d + 64 * k, _mm256_slli_epi16(_mm256_cvtepu8_epi16(load128(s + 16 * k)), 8), 1.0f, stream);
}

/* Runs a step over n elements.  The ends go through the portable kernel (same bits), and so,
 * when streaming, do the elements before dst's first 32-byte boundary, since non-temporal
 * stores need that alignment; a dst not aligned to its element size does not stream. */
#define AVX2_KERNEL(name, S, D, step, portable)                                    \
    MS_AVX2 static void name(void *dst, const void *src, int64_t n, bool stream) {  \
        const int64_t ds = sizeof(D), ss = sizeof(S);                               \
        unsigned char *d = dst;                                                     \
        const unsigned char *s = src;                                               \
        int64_t i = 0;                                                              \
        if (stream && (uintptr_t)d % ds == 0) {                                     \
            i = (int64_t)((-(uintptr_t)d & 31) / ds);                               \
            if (i > n) i = n;                                                       \
            portable(d, s, i, false);                                               \
            for (; i + 32 <= n; i += 32) step(d + i * ds, s + i * ss, true);        \
            _mm_sfence();                                                           \
        } else {                                                                    \
            for (; i + 32 <= n; i += 32) step(d + i * ds, s + i * ss, false);       \
        }                                                                           \
        portable(d + i * ds, s + i * ss, n - i, false);                             \
    }

AVX2_KERNEL(avx2_f32_to_bf16, float, uint16_t, step_f32_to_bf16, port_f32_to_bf16)
AVX2_KERNEL(avx2_bf16_to_f32, uint16_t, float, step_bf16_to_f32, port_bf16_to_f32)
AVX2_KERNEL(avx2_f32_to_f16, float, uint16_t, step_f32_to_f16, port_f32_to_f16)
AVX2_KERNEL(avx2_f16_to_f32, uint16_t, float, step_f16_to_f32, port_f16_to_f32)
AVX2_KERNEL(avx2_f32_to_e4m3, float, uint8_t, step_f32_to_e4m3, port_f32_to_e4m3)
AVX2_KERNEL(avx2_e4m3_to_f32, uint8_t, float, step_e4m3_to_f32, port_e4m3_to_f32)
AVX2_KERNEL(avx2_f32_to_e5m2, float, uint8_t, step_f32_to_e5m2, port_f32_to_e5m2)
AVX2_KERNEL(avx2_e5m2_to_f32, uint8_t, float, step_e5m2_to_f32, port_e5m2_to_f32)

/* AVX2 through the builtin, which also checks that the OS saves the ymm registers; F16C by
 * CPUID leaf 1, which every compiler's <cpuid.h> knows (clang's builtin does not). */
static bool cpu_has_avx2(void) {
    unsigned eax, ebx, ecx, edx;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C);
}
#else
static bool cpu_has_avx2(void) { return false; }
#endif

/* ---------------------------------------------------------------- hubs and dispatch */

/* How the pairs are routed: every pair goes through one "hub" type, loading the source
 * into the hub type and storing the hub type into the destination, in blocks of a small
 * stack buffer unless one side is the hub type itself (ms__cast_contig):
 *  - f32 when either side is f32, f16, bf16, e4m3 or e5m2;
 *  - else f64 when the source is f64 (the destination is then an integer or bool);
 *  - else int64 (integers and bool to integers, bool or f64).
 * to[t]: t -> the hub type; from[t]: hub type -> t.  NULL for the hub type itself and for
 * dtypes routed through another hub. */
typedef struct cast_hub {
    ms_dtype type;
    cast_fn to[MS_DTYPE_COUNT];
    cast_fn from[MS_DTYPE_COUNT];
} cast_hub;

/* The f32 hub's kernels that both paths share. */
#define F32_HUB_SHARED_TO                                                                     \
    [MS_F64] = f64_to_f32_k, [MS_I64] = i64_to_f32, [MS_I32] = i32_to_f32, [MS_I8] = i8_to_f32, \
    [MS_U8] = u8_to_f32, [MS_BOOL] = bool_to_f32
#define F32_HUB_SHARED_FROM                                                                   \
    [MS_F64] = f32_to_f64_k, [MS_I64] = f32_to_i64, [MS_I32] = f32_to_i32, [MS_I8] = f32_to_i8, \
    [MS_U8] = f32_to_u8, [MS_BOOL] = f32_to_bool

static const cast_hub f32_hub_portable = {
    MS_F32,
    .to = {F32_HUB_SHARED_TO, [MS_BF16] = port_bf16_to_f32, [MS_F16] = port_f16_to_f32,
           [MS_F8E4M3] = port_e4m3_to_f32, [MS_F8E5M2] = port_e5m2_to_f32},
    .from = {F32_HUB_SHARED_FROM, [MS_BF16] = port_f32_to_bf16, [MS_F16] = port_f32_to_f16,
             [MS_F8E4M3] = port_f32_to_e4m3, [MS_F8E5M2] = port_f32_to_e5m2},
};

#ifdef MS_CAST_HAVE_AVX2
static const cast_hub f32_hub_avx2 = {
    MS_F32,
    .to = {F32_HUB_SHARED_TO, [MS_BF16] = avx2_bf16_to_f32, [MS_F16] = avx2_f16_to_f32,
           [MS_F8E4M3] = avx2_e4m3_to_f32, [MS_F8E5M2] = avx2_e5m2_to_f32},
    .from = {F32_HUB_SHARED_FROM, [MS_BF16] = avx2_f32_to_bf16, [MS_F16] = avx2_f32_to_f16,
             [MS_F8E4M3] = avx2_f32_to_e4m3, [MS_F8E5M2] = avx2_f32_to_e5m2},
};
#endif

static const cast_hub f64_hub = {
    MS_F64,
    .from = {[MS_I64] = f64_to_i64, [MS_I32] = f64_to_i32, [MS_I8] = f64_to_i8, [MS_U8] = f64_to_u8,
             [MS_BOOL] = f64_to_bool},
};

static const cast_hub i64_hub = {
    MS_I64,
    .to = {[MS_I32] = i32_to_i64, [MS_I8] = i8_to_i64, [MS_U8] = u8_to_i64, [MS_BOOL] = bool_to_i64},
    .from = {[MS_I32] = i64_to_i32, [MS_I8] = i64_to_i8, [MS_U8] = i64_to_u8, [MS_BOOL] = i64_to_bool,
             [MS_F64] = i64_to_f64},
};

/* MS_CAST_AUTO until the first cast or ms_cast_set_impl resolves it. */
static atomic_int cast_impl = MS_CAST_AUTO;

static ms_cast_impl impl_now(void) {
    int impl = atomic_load_explicit(&cast_impl, memory_order_relaxed);
    if (impl == MS_CAST_AUTO) {
        int resolved = cpu_has_avx2() ? MS_CAST_AVX2 : MS_CAST_PORTABLE;
        /* Only AUTO is replaced: a concurrent ms_cast_set_impl wins. */
        if (atomic_compare_exchange_strong(&cast_impl, &impl, resolved)) impl = resolved;
    }
    return (ms_cast_impl)impl;
}

static const cast_hub *f32_hub_now(void) {
#ifdef MS_CAST_HAVE_AVX2
    if (impl_now() == MS_CAST_AVX2) return &f32_hub_avx2;
#endif
    return &f32_hub_portable;
}

static bool in_f32_family(ms_dtype t) {
    return t == MS_F32 || t == MS_F16 || t == MS_BF16 || t == MS_F8E4M3 || t == MS_F8E5M2;
}

void ms__cast_contig(void *dst, ms_dtype dst_dtype, const void *src, ms_dtype src_dtype, int64_t n) {
    const int64_t ds = ms_dtype_size(dst_dtype), ss = ms_dtype_size(src_dtype);
    if (n == 0) return;
    if (dst_dtype == src_dtype) {
        if (dst != src) memcpy(dst, src, (size_t)(n * ds));
        return;
    }
    const cast_hub *hub = in_f32_family(src_dtype) || in_f32_family(dst_dtype) ? f32_hub_now()
                          : src_dtype == MS_F64                                ? &f64_hub
                                                                               : &i64_hub;
    const bool stream = n * ds >= MS_STREAM_BYTES;
    cast_fn load = src_dtype == hub->type ? NULL : hub->to[src_dtype];
    cast_fn store = dst_dtype == hub->type ? NULL : hub->from[dst_dtype];
    if (!load) {
        store(dst, src, n, stream);
    } else if (!store) {
        load(dst, src, n, stream);
    } else {
        _Alignas(64) unsigned char stage[MS_STAGE_BYTES];
        const int64_t block = MS_STAGE_BYTES / ms_dtype_size(hub->type);
        unsigned char *d = dst;
        const unsigned char *s = src;
        for (int64_t i = 0; i < n; i += block) {
            const int64_t m = n - i < block ? n - i : block;
            load(stage, s + i * ss, m, false);
            store(d + i * ds, stage, m, stream);
        }
    }
}

/* ---------------------------------------------------------------- public API */

/* The rules (the contract; tests/c/test_cast.c checks each of them):
 *  - f32 -> bf16: round to nearest even, (u + 0x7FFF + ((u >> 16) & 1)) >> 16 on the bits;
 *    NaN -> (u >> 16) | 0x0040 (quiet, sign and top payload kept).  bf16 -> f32: u << 16.
 *  - f32 -> f16: IEEE binary16, round to nearest even including subnormals; overflow -> inf
 *    (f16 does not saturate); NaN -> sign | 0x7E00 | (mantissa >> 13).  That is exactly what
 *    the F16C instruction vcvtps2ph gives, for all 2^32 inputs.  f16 -> f32 is exact; a NaN
 *    is quieted with its payload kept, as vcvtph2ps does.
 *  - fp8, OCP: e4m3fn (bias 7, max 448 = 0x7E, no inf, NaN = sign | 0x7F, subnormals down
 *    to 2^-9) and e5m2 (bias 15, max 57344 = 0x7B, inf 0x7C, NaN made as sign | 0x7E).
 *    f32 -> fp8 rounds to nearest even and saturates to the largest finite value, inf
 *    included ("satfinite"); the sign of zero and of an underflow is kept; NaN -> the NaN
 *    above.  fp8 -> f32 is exact: e4m3 NaN -> sign | 0x7FC00000; e5m2 as f16 (b << 8).
 *  - f64 <-> bf16/f16/fp8 go through f32 (double rounding, as PyTorch does for double ->
 *    half and bfloat16).  f64 <-> f32 are C casts; a NaN keeps its sign and the top of
 *    its payload and is made quiet, as x86 does (cast_scalar.h spells it out for the GPU).
 *  - integer or bool -> f32: one C cast (one rounding); -> f64: direct; -> narrower floats:
 *    through that f32.
 *  - float -> integer: truncate toward zero, NaN -> 0, saturate to the target's range.
 *    integer -> integer: wraps like a C cast through int64.
 *  - anything -> bool: x != 0 (NaN -> 1).  bool -> anything: 0 or 1 (any nonzero byte is 1).
 *  - same dtype: memcpy (nothing to do when dst == src).
 * Pointers need no alignment at all; dst == src is allowed when the element sizes are
 * equal (every kernel reads an element, or a block of them, before writing it back).
 * Rounding assumes the default floating-point environment (round to nearest), as every C
 * float cast does: subnormal results of f16 and fp8 come from a float add (round_narrow in
 * cast_scalar.h). */
ms_status ms_cast(void *dst, ms_dtype dst_dtype, const void *src, ms_dtype src_dtype, int64_t n) {
    if (!ms__dtype_valid(src_dtype))
        return ms__fail(MS_ERR_ARG, "ms_cast: invalid source dtype %d (expected 0..%d)", (int)src_dtype, MS_DTYPE_COUNT - 1);
    if (!ms__dtype_valid(dst_dtype))
        return ms__fail(MS_ERR_ARG, "ms_cast: invalid destination dtype %d (expected 0..%d)", (int)dst_dtype, MS_DTYPE_COUNT - 1);
    if (n < 0) return ms__fail(MS_ERR_ARG, "ms_cast: negative element count %lld", (long long)n);
    int64_t bytes; /* n * the larger element size must fit, for every offset below */
    if (!ms__mul_ok(n, ms_dtype_size(dst_dtype) > ms_dtype_size(src_dtype) ? ms_dtype_size(dst_dtype)
                                                                             : ms_dtype_size(src_dtype),
                    &bytes))
        return ms__fail(MS_ERR_OVERFLOW, "ms_cast: %lld elements overflow a byte count", (long long)n);
    if (n > 0 && (!dst || !src))
        return ms__fail(MS_ERR_ARG, "ms_cast: %s is NULL with n = %lld", dst ? "src" : "dst", (long long)n);
    if (dst == src && n > 0 && ms_dtype_size(dst_dtype) != ms_dtype_size(src_dtype))
        return ms__fail(MS_ERR_ARG,
                        "ms_cast: in place (dst == src) needs equal element sizes, got %s (%d bytes) -> %s (%d bytes)",
                        ms_dtype_name(src_dtype), ms_dtype_size(src_dtype), ms_dtype_name(dst_dtype),
                        ms_dtype_size(dst_dtype));
    ms__cast_contig(dst, dst_dtype, src, src_dtype, n);
    return ms__ok();
}

ms_status ms_cast_set_impl(ms_cast_impl impl) {
    switch (impl) {
    case MS_CAST_AUTO:
        impl = cpu_has_avx2() ? MS_CAST_AVX2 : MS_CAST_PORTABLE;
        break;
    case MS_CAST_PORTABLE:
        break;
    case MS_CAST_AVX2:
        if (!cpu_has_avx2())
#ifdef MS_CAST_HAVE_AVX2
            return ms__fail(MS_ERR_NOT_BUILT, "ms_cast_set_impl: the AVX2 cast kernels need a CPU with AVX2 and F16C; this one lacks them");
#else
            return ms__fail(MS_ERR_NOT_BUILT, "ms_cast_set_impl: not built with AVX2 cast kernels (x86-64 with GCC or Clang only)");
#endif
        break;
    default:
        return ms__fail(MS_ERR_ARG, "ms_cast_set_impl: unknown impl %d (expected 0 auto, 1 portable, 2 avx2)",
                        (int)impl);
    }
    atomic_store(&cast_impl, (int)impl);
    return ms__ok();
}

ms_cast_impl ms_cast_get_impl(void) { return impl_now(); }
