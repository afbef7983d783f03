/*
 * cast_element.h: one element of ms_cast between any two dtypes, routed through the hub
 * cast.c routes it through: f32 when either side is f32, f16, bf16, e4m3 or e5m2; else f64
 * when the source is f64; else int64, with the scalar rules of cast_scalar.h.  Plain C that
 * nvcc compiles for the device (core/cuda/cast.cu's generic kernel) and a C compiler for the
 * host, where tests/c/test_cast_element.c checks it against ms_cast for every pair.
 */
#ifndef MS_CAST_ELEMENT_H
#define MS_CAST_ELEMENT_H

#include "moonshard.h"

#include "../src/cast_scalar.h"

MS_HD static inline int ms_in_f32_family(int t) {
    return t == MS_F32 || t == MS_F16 || t == MS_BF16 || t == MS_F8E4M3 || t == MS_F8E5M2;
}

/* Element i of p (dtype t) as the f32 hub sees it. */
MS_HD static inline float ms_load_f32(const void *p, int64_t i, int t) {
    switch (t) {
    case MS_F16: return f16_to_f32(((const uint16_t *)p)[i]);
    case MS_BF16: return bf16_to_f32(((const uint16_t *)p)[i]);
    case MS_F8E4M3: return e4m3_to_f32(((const uint8_t *)p)[i]);
    case MS_F8E5M2: return e5m2_to_f32(((const uint8_t *)p)[i]);
    case MS_F64: return f64_to_f32(((const double *)p)[i]);
    case MS_I64: return (float)((const int64_t *)p)[i];
    case MS_I32: return (float)((const int32_t *)p)[i];
    case MS_I8: return (float)((const int8_t *)p)[i];
    case MS_U8: return (float)((const uint8_t *)p)[i];
    case MS_BOOL: return ((const uint8_t *)p)[i] != 0;
    default: return ((const float *)p)[i];
    }
}

/* x from the f32 hub into element i of p (dtype t). */
MS_HD static inline void ms_store_f32(void *p, int64_t i, int t, float x) {
    switch (t) {
    case MS_F16: ((uint16_t *)p)[i] = f32_to_f16(x); break;
    case MS_BF16: ((uint16_t *)p)[i] = f32_to_bf16(x); break;
    case MS_F8E4M3: ((uint8_t *)p)[i] = f32_to_e4m3(x); break;
    case MS_F8E5M2: ((uint8_t *)p)[i] = f32_to_e5m2(x); break;
    case MS_F64: ((double *)p)[i] = f32_to_f64(x); break;
    case MS_I64: ((int64_t *)p)[i] = sat_trunc(x, INT64_MIN, INT64_MAX); break;
    case MS_I32: ((int32_t *)p)[i] = (int32_t)sat_trunc(x, INT32_MIN, INT32_MAX); break;
    case MS_I8: ((int8_t *)p)[i] = (int8_t)sat_trunc(x, INT8_MIN, INT8_MAX); break;
    case MS_U8: ((uint8_t *)p)[i] = (uint8_t)sat_trunc(x, 0, UINT8_MAX); break;
    case MS_BOOL: ((uint8_t *)p)[i] = x != 0; break;
    default: ((float *)p)[i] = x; break;
    }
}

/* An f64 into element i of p: an integer (truncated, saturated) or bool, the f64 hub's
 * only destinations. */
MS_HD static inline void ms_store_from_f64(void *p, int64_t i, int t, double x) {
    switch (t) {
    case MS_I64: ((int64_t *)p)[i] = sat_trunc(x, INT64_MIN, INT64_MAX); break;
    case MS_I32: ((int32_t *)p)[i] = (int32_t)sat_trunc(x, INT32_MIN, INT32_MAX); break;
    case MS_I8: ((int8_t *)p)[i] = (int8_t)sat_trunc(x, INT8_MIN, INT8_MAX); break;
    case MS_U8: ((uint8_t *)p)[i] = (uint8_t)sat_trunc(x, 0, UINT8_MAX); break;
    default: ((uint8_t *)p)[i] = x != 0; break; /* MS_BOOL */
    }
}

/* Element i of p (an integer or bool) as int64. */
MS_HD static inline int64_t ms_load_i64(const void *p, int64_t i, int t) {
    switch (t) {
    case MS_I32: return ((const int32_t *)p)[i];
    case MS_I8: return ((const int8_t *)p)[i];
    case MS_U8: return ((const uint8_t *)p)[i];
    case MS_BOOL: return ((const uint8_t *)p)[i] != 0;
    default: return ((const int64_t *)p)[i];
    }
}

/* An int64 into element i of p: an integer (wrapping like a C cast), bool or f64. */
MS_HD static inline void ms_store_i64(void *p, int64_t i, int t, int64_t x) {
    switch (t) {
    case MS_I32: ((int32_t *)p)[i] = (int32_t)x; break;
    case MS_I8: ((int8_t *)p)[i] = (int8_t)x; break;
    case MS_U8: ((uint8_t *)p)[i] = (uint8_t)x; break;
    case MS_BOOL: ((uint8_t *)p)[i] = x != 0; break;
    case MS_F64: ((double *)p)[i] = (double)x; break;
    default: ((int64_t *)p)[i] = x; break;
    }
}

/* dst[di] (dtype dt) <- src[si] (dtype st), dt != st, as ms_cast does it. */
MS_HD static inline void ms_cast_element_at(void *dst, int64_t di, int dt, const void *src, int st, int64_t si) {
    if (ms_in_f32_family(st) || ms_in_f32_family(dt)) ms_store_f32(dst, di, dt, ms_load_f32(src, si, st));
    else if (st == MS_F64) ms_store_from_f64(dst, di, dt, ((const double *)src)[si]);
    else ms_store_i64(dst, di, dt, ms_load_i64(src, si, st));
}

/* dst[i] (dtype dt) <- src[i] (dtype st), dt != st. */
MS_HD static inline void ms_cast_element(void *dst, int dt, const void *src, int st, int64_t i) {
    ms_cast_element_at(dst, i, dt, src, st, i);
}

#endif /* MS_CAST_ELEMENT_H */
