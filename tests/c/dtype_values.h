/*
 * dtype_values.h: test values of any dtype for the element-wise checks of the device code
 * compiled for the host (test_cast_element.c, test_unit_element.c): probes of every rule,
 * NaN and the infinities (converted by ms_cast), then RANDOM random bit patterns.
 */
#ifndef MS_DTYPE_VALUES_H
#define MS_DTYPE_VALUES_H

#include "check.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { RANDOM = 4096 };

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static inline uint64_t next(void) {
    uint64_t z = (rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static const double probes[] = {
    0.0, -0.0, 1.0, -1.0, 0.5, 1.0 / 3, -2.5, 3.5, 255.0, 256.0, -129.0, 127.5, 65504.0, 65520.0, 1e6, -1e6,
    448.0, 464.0, 57344.0, 1e-8, -1e-8, 6e-8, 1.5e-45, 3.4e38, -3.4e38, 1e300, 2147483648.0, -2147483649.0,
    9.2233720368547758e18, -9.3e18, 1e-320, 16777217.0, 0.1, -0.7, 2.0e-38, 1.0e-39};

/* The source values of dtype s: the probes (and NaN, inf) by ms_cast, then random bits. */
static inline int64_t sources(ms_dtype s, unsigned char *buf) {
    const int64_t np = sizeof probes / sizeof probes[0];
    double p[sizeof probes / sizeof probes[0] + 3];
    memcpy(p, probes, sizeof probes);
    p[np] = NAN, p[np + 1] = INFINITY, p[np + 2] = -INFINITY;
    CHECK_OK(ms_cast(buf, s, p, MS_F64, np + 3));
    const int es = ms_dtype_size(s);
    for (int64_t i = 0; i < RANDOM; i++) {
        uint64_t r = next();
        memcpy(buf + (np + 3 + i) * es, &r, (size_t)es);
    }
    return np + 3 + RANDOM;
}

#endif /* MS_DTYPE_VALUES_H */
