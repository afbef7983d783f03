/*
 * cast_scalar.h: the scalar rules of ms_cast (cast.c states them), one element at a time,
 * shared by the CPU kernels (cast.c) and the CUDA kernels (core/cuda/cast.cu): both
 * compile these very functions, so a device cast gives the CPU's bits by construction
 * (tests/gpu/test_cuda.c checks it on every f32 anyway).  Under nvcc every function is
 * __host__ __device__; the device code must keep IEEE float adds (no -ftz, no fast math:
 * the subnormal rounding of round_narrow is a float add).
 */
#ifndef MS_CAST_SCALAR_H
#define MS_CAST_SCALAR_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define MS_HD __host__ __device__
#else
#define MS_HD
#endif


MS_HD static inline uint32_t f32_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
#endif
}

MS_HD static inline float f32_from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

MS_HD static inline uint64_t f64_bits(double d) {
#ifdef __CUDA_ARCH__
    return (uint64_t)__double_as_longlong(d);
#else
    uint64_t u;
    memcpy(&u, &d, sizeof u);
    return u;
#endif
}

MS_HD static inline double f64_from_bits(uint64_t u) {
#ifdef __CUDA_ARCH__
    return __longlong_as_double((long long)u);
#else
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
#endif
}

/* f64 -> f32 and f32 -> f64 as C casts on x86 do them, NaN included: a NaN keeps its sign
 * and the top of its payload and comes out quiet.  Spelled out because a GPU's conversions
 * turn every NaN into the canonical one. */
MS_HD static inline float f64_to_f32(double x) {
    if (x == x) return (float)x;
    uint64_t u = f64_bits(x);
    return f32_from_bits(((uint32_t)(u >> 32) & 0x80000000u) | 0x7FC00000u | (uint32_t)((u >> 29) & 0x3FFFFF));
}

MS_HD static inline double f32_to_f64(float x) {
    if (x == x) return (double)x;
    uint32_t u = f32_bits(x);
    return f64_from_bits(((uint64_t)(u & 0x80000000u) << 32) | 0x7FF8000000000000ull |
                         ((uint64_t)(u & 0x3FFFFF) << 29));
}

/* Rounds a (the magnitude bits of an f32, not NaN) to nearest even in a float format with
 * `mbits` mantissa bits and exponent bias `bias` (< 127).  Returns the format's bits without
 * the sign, unclamped: a value past the largest finite comes out above its code, and the
 * caller clamps to inf or to the largest finite.  The AVX2 twin is round_narrow8. */
MS_HD static inline uint32_t round_narrow(uint32_t a, uint32_t bias, uint32_t mbits) {
    const uint32_t shift = 23 - mbits;
    if (a >= (128 - bias) << 23) { /* normal in the target: rebias, round off `shift` bits */
        uint32_t r = a - ((127 - bias) << 23);
        return (r + (1u << (shift - 1)) - 1 + ((r >> shift) & 1)) >> shift; /* carry may bump the exponent */
    }
    /* Subnormal in the target: add the f32 whose ulp is the target's smallest subnormal,
     * 2^(1 - bias - mbits); the float add rounds to nearest even (the default FP environment,
     * which every float cast assumes), and the bits above the magic's count the subnormals,
     * up to 2^mbits, the smallest normal. */
    const float magic = f32_from_bits((151 - bias - mbits) << 23);
    return f32_bits(f32_from_bits(a) + magic) - f32_bits(magic);
}

MS_HD static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x0040);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

MS_HD static inline float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

MS_HD static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f32_bits(f), sign = (u >> 16) & 0x8000, a = u & 0x7FFFFFFF;
    if (a > 0x7F800000) return (uint16_t)(sign | 0x7E00 | ((a >> 13) & 0x3FF));
    uint32_t code = round_narrow(a, 15, 10);
    return (uint16_t)(sign | (code < 0x7C00 ? code : 0x7C00));
}

/* A finite value of a narrow float format (sign already at bit 31) as f32, exactly. */
MS_HD static inline float widen_finite(uint32_t sign, uint32_t e, uint32_t m, uint32_t bias, uint32_t mbits) {
    if (e == 0) /* m * 2^(1 - bias - mbits): an exact product, every result is an f32 normal */
        return f32_from_bits(sign | f32_bits((float)m * f32_from_bits((128 - bias - mbits) << 23)));
    return f32_from_bits(sign | ((e + 127 - bias) << 23) | (m << (23 - mbits)));
}

MS_HD static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0x1F) /* inf, or NaN quieted with its payload, as vcvtph2ps */
        return f32_from_bits(sign | 0x7F800000 | (m ? 0x400000 | (m << 13) : 0));
    return widen_finite(sign, e, m, 15, 10);
}

/* f32 -> fp8, satfinite.  `maxcode` is the largest finite code, `nancode` the NaN made. */
MS_HD static inline uint8_t f32_to_fp8(float f, uint32_t bias, uint32_t mbits, uint32_t maxcode,
                                 uint32_t nancode) {
    uint32_t u = f32_bits(f), sign = (u >> 24) & 0x80, a = u & 0x7FFFFFFF;
    if (a > 0x7F800000) return (uint8_t)(sign | nancode);
    uint32_t code = round_narrow(a, bias, mbits);
    return (uint8_t)(sign | (code < maxcode ? code : maxcode));
}

MS_HD static inline uint8_t f32_to_e4m3(float f) { return f32_to_fp8(f, 7, 3, 0x7E, 0x7F); }
MS_HD static inline uint8_t f32_to_e5m2(float f) { return f32_to_fp8(f, 15, 2, 0x7B, 0x7E); }

MS_HD static inline float e4m3_to_f32(uint8_t b) {
    uint32_t sign = (uint32_t)(b & 0x80) << 24;
    if ((b & 0x7F) == 0x7F) return f32_from_bits(sign | 0x7FC00000);
    return widen_finite(sign, (b >> 3) & 0xF, b & 0x7, 7, 3);
}

/* e5m2 is the top byte of an f16, so the f16 rules (inf, NaN quieting) carry over. */
MS_HD static inline float e5m2_to_f32(uint8_t b) { return f16_to_f32((uint16_t)(b << 8)); }

/* float -> integer: truncate, NaN -> 0, saturate to [lo, hi].  (double)INT64_MAX is 2^63,
 * so x >= it saturates and every x that reaches the cast fits. */
MS_HD static inline int64_t sat_trunc(double x, int64_t lo, int64_t hi) {
    if (x != x) return 0;
    if (x <= (double)lo) return lo;
    if (x >= (double)hi) return hi;
    return (int64_t)x;
}

#endif /* MS_CAST_SCALAR_H */
