/*
 * test_cast_element.c: the element-wise cast of the CUDA kernels (core/cuda/cast_element.h,
 * compiled here for the host) against ms_cast, for every ordered pair of distinct dtypes:
 * values that probe each rule (converted into the source dtype by ms_cast) and random bit
 * patterns of the source dtype (NaN payloads, bool bytes other than 0 and 1 included).
 * The device compiles the same source, so what holds here holds there except for the
 * hardware's own conversions, which the GPU test (tests/gpu/test_cuda.c) checks on a GPU.
 * Also: f64 <-> f32 of NaNs as spelled out in cast_scalar.h equal the host's C casts.
 */
#include "check.h"
#include "dtype_values.h"

#include "../../core/cuda/cast_element.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(void) {
    static unsigned char src[(RANDOM + 64) * 8], want[(RANDOM + 64) * 8], got[(RANDOM + 64) * 8];
    int pairs = 0, bad_pairs = 0;
    for (int s = 0; s < MS_DTYPE_COUNT; s++)
        for (int d = 0; d < MS_DTYPE_COUNT; d++) {
            if (s == d) continue;
            int64_t n = sources((ms_dtype)s, src);
            CHECK_OK(ms_cast(want, (ms_dtype)d, src, (ms_dtype)s, n));
            for (int64_t i = 0; i < n; i++) ms_cast_element(got, d, src, s, i);
            const int es = ms_dtype_size((ms_dtype)d);
            int64_t bad = 0;
            for (int64_t i = 0; i < n; i++)
                if (memcmp(got + i * es, want + i * es, (size_t)es) && !bad++)
                    fprintf(stderr, "%s -> %s: element %lld differs\n", ms_dtype_name((ms_dtype)s),
                            ms_dtype_name((ms_dtype)d), (long long)i);
            pairs++;
            bad_pairs += bad != 0;
        }
    printf("cast_element: %d pairs x %d values, %d pairs differ from ms_cast\n", pairs,
           (int)(sizeof probes / sizeof probes[0]) + 3 + RANDOM, bad_pairs);
    CHECK(pairs == MS_DTYPE_COUNT * (MS_DTYPE_COUNT - 1) && bad_pairs == 0);

    /* NaN payloads through f64 <-> f32: the spelled-out rule equals the host's C casts */
    int nan_bad = 0;
    for (int i = 0; i < 100000; i++) {
        uint64_t r = next() | 0x7FF0000000000001ull; /* a NaN of either sign, any payload */
        double dv;
        memcpy(&dv, &r, 8);
        float fc = (float)dv, fr = f64_to_f32(dv);
        uint32_t u = (uint32_t)next() | 0x7F800001u, a, b;
        float fv;
        memcpy(&fv, &u, 4);
        double dc = (double)fv, dr = f32_to_f64(fv);
        uint64_t x, y;
        memcpy(&a, &fc, 4), memcpy(&b, &fr, 4), memcpy(&x, &dc, 8), memcpy(&y, &dr, 8);
        nan_bad += a != b || x != y;
    }
    printf("f64 <-> f32 on 100000 NaNs each way: %d differ from the host's casts\n", nan_bad);
    CHECK(nan_bad == 0);
    return check_summary("test_cast_element");
}
