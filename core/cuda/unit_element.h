/*
 * unit_element.h: one element of the shard units' element-wise step (unit_math.h's
 * ms_ew_op) with the rules of the host's ms__ew (unit_math.c): dst widened to f32 (f64 when
 * dst or an added src is f64), src rounded to dst's dtype first when asked, one operation,
 * rounded back, every conversion through the casts' own element functions
 * (cast_element.h).  Plain C that nvcc compiles for the device (core/cuda/unit.cu) and a C
 * compiler for the host, where tests/c/test_unit_element.c checks it against ms__ew.
 */
#ifndef MS_UNIT_ELEMENT_H
#define MS_UNIT_ELEMENT_H

#include "cast_element.h"

#include "../src/unit_math.h"

/* Element i of p (dtype t) as ms_cast gives it in f64. */
MS_HD static inline double ms_load_f64(const void *p, int64_t i, int t) {
    if (t == MS_F64) return ((const double *)p)[i];
    if (ms_in_f32_family(t)) return f32_to_f64(ms_load_f32(p, i, t));
    return (double)ms_load_i64(p, i, t);
}

/* An f64 into element i of p (dtype t) as ms_cast puts it. */
MS_HD static inline void ms_store_f64(void *p, int64_t i, int t, double x) {
    if (t == MS_F64) ((double *)p)[i] = x;
    else if (ms_in_f32_family(t)) ms_store_f32(p, i, t, f64_to_f32(x));
    else ms_store_from_f64(p, i, t, x);
}

/* Element i of src (dtype sd) as an addend of dst's dtype dd: rounded to dd first when
 * round_src, read in f64 (wide) or f32. */
MS_HD static inline double ms_ew_addend(const void *src, int sd, int dd, int round_src, int wide, int64_t i) {
    if (round_src && sd != dd) {
        union {
            double f64;
            float f32;
            uint16_t b16;
            uint8_t b8;
        } r; /* one element of dd, whichever it is */
        ms_cast_element_at(&r, 0, dd, src, sd, i);
        return wide ? ms_load_f64(&r, 0, dd) : ms_load_f32(&r, 0, dd);
    }
    return wide ? ms_load_f64(src, i, sd) : ms_load_f32(src, i, sd);
}

/* dst[i] (float dtype dd) <- dst[i] op (s or src[i]), as ms__ew does it. */
MS_HD static inline void ms_ew_element(int op, void *dst, int dd, double s, const void *src, int sd, int round_src,
                                       int64_t i) {
    const int add = op == MS_EW_ADD;
    if (dd == MS_F64 || (add && sd == MS_F64)) {
        double a = ms_load_f64(dst, i, dd);
        if (add) a += ms_ew_addend(src, sd, dd, round_src, 1, i);
        else a = op == MS_EW_MUL ? a * s : a / s;
        ms_store_f64(dst, i, dd, a);
    } else {
        float a = ms_load_f32(dst, i, dd);
        const float sf = (float)s;
        if (add) a += (float)ms_ew_addend(src, sd, dd, round_src, 0, i);
        else a = op == MS_EW_MUL ? a * sf : a / sf;
        ms_store_f32(dst, i, dd, a);
    }
}

#endif /* MS_UNIT_ELEMENT_H */
