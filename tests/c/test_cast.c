/*
 * test_cast.c: ms_cast against references computed another way.
 *
 *  1. every f32 (2^32 inputs) to bf16, f16, e4m3 and e5m2: the AVX2 kernels == the portable
 *     scalars, bit for bit, NaNs included; the portable scalars == a reference built from
 *     the format definitions (decoded values, midpoints between neighbours, ties to the even
 *     code, overflow to inf or saturation); NaN inputs give the NaN of the rules; f16 == the
 *     F16C instruction (_cvtss_sh) on every input.
 *  2. every bf16 and f16 (65536) and every e4m3 and e5m2 (256) to f32 on both paths: the
 *     value of the format definition, NaNs quieted as the rules say, f16 == _cvtsh_ss.
 *  3. fp8 and f16 edge cases written out by hand.
 *  4. every pair of dtypes on a vector of interesting values against a model of the rules.
 *  5. lengths around the vector width, unaligned pointers, guard bytes, in-place casts.
 *  6. argument errors, by status and message.
 *
 * MOONSHARD_TEST_QUICK=1 sweeps 1 block in 61 of part 1 (for sanitizer builds).
 * Prints each check with its mismatch count; exits 1 when any count is not 0.
 */
#include "ms_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TEST_F16C __attribute__((target("f16c")))
#define HAVE_X86 1
#endif

static int failures;
static bool quick;
static bool has_avx2; /* the AVX2 path is available, so each sweep checks it */

static void report(const char *what, long long mismatches) {
    printf("  %-58s mismatches %lld\n", what, mismatches);
    if (mismatches) failures++;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void set_impl(ms_cast_impl impl) {
    if (ms_cast_set_impl(impl) != MS_OK) {
        fprintf(stderr, "ms_cast_set_impl(%d): %s\n", (int)impl, ms_last_error());
        exit(1);
    }
}

/* ---------------------------------------------------------------- the formats, by definition */

/* A binary float format: 1 sign bit, ebits exponent bits, mbits mantissa bits. */
typedef struct ref_fmt {
    const char *name;
    ms_dtype dtype;
    int ebits, mbits, bias;
    bool ieee;     /* exponent all ones = inf / NaN; otherwise (e4m3fn) only S.1111.111 is NaN */
    bool saturate; /* f32 past the largest finite -> the largest finite, not inf */
    uint32_t (*nan_rule)(uint32_t f32_bits); /* the code a NaN input must give */
    /* Filled by ref_init. */
    uint32_t sign_bit;
    uint32_t top;  /* the largest magnitude code an f32 can round to: inf or the largest finite */
    double *value; /* value[code] (NaN for NaN codes), from the definition */
    /* up[c] for c < top: the smallest f32 magnitude bits that round above c.  The midpoint
     * between the values of c and c + 1 is an f32; a tie stays at c when c is even. */
    uint32_t *up;
} ref_fmt;

static uint32_t nan_bf16(uint32_t u) { return ((u >> 16) | 0x40) & 0xFFFF; }
static uint32_t nan_f16(uint32_t u) { return ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF); }
static uint32_t nan_e4m3(uint32_t u) { return ((u >> 24) & 0x80) | 0x7F; }
static uint32_t nan_e5m2(uint32_t u) { return ((u >> 24) & 0x80) | 0x7E; }

enum { BF16, F16, E4M3, E5M2, NFMT };
static ref_fmt fmts[NFMT] = {
    [BF16] = {"bf16", MS_BF16, 8, 7, 127, true, false, nan_bf16, 0, 0, NULL, NULL},
    [F16] = {"f16", MS_F16, 5, 10, 15, true, false, nan_f16, 0, 0, NULL, NULL},
    [E4M3] = {"e4m3", MS_F8E4M3, 4, 3, 7, false, true, nan_e4m3, 0, 0, NULL, NULL},
    [E5M2] = {"e5m2", MS_F8E5M2, 5, 2, 15, true, true, nan_e5m2, 0, 0, NULL, NULL},
};

static ref_fmt *fmt_of(ms_dtype t) {
    for (int f = 0; f < NFMT; f++)
        if (fmts[f].dtype == t) return &fmts[f];
    return NULL;
}

/* The value of a magnitude code as if the exponent field had no special values. */
static double finite_value(const ref_fmt *f, uint32_t c) {
    int e = (int)(c >> f->mbits), m = (int)(c & ((1u << f->mbits) - 1));
    if (e == 0) return ldexp(m, 1 - f->bias - f->mbits);
    return ldexp(1.0 + ldexp(m, -f->mbits), e - f->bias);
}

static void ref_init(ref_fmt *f) {
    const uint32_t ncodes = 1u << (1 + f->ebits + f->mbits), emax = (1u << f->ebits) - 1;
    const uint32_t inf_code = emax << f->mbits, all_ones = ncodes / 2 - 1;
    f->sign_bit = ncodes / 2;
    f->value = malloc(ncodes * sizeof(double));
    for (uint32_t code = 0; code < ncodes; code++) {
        uint32_t c = code & all_ones;
        double v = finite_value(f, c);
        if (f->ieee && c >= inf_code) v = c == inf_code ? INFINITY : NAN;
        if (!f->ieee && c == all_ones) v = NAN;
        f->value[code] = code & f->sign_bit ? -v : v;
    }
    f->top = f->saturate ? (f->ieee ? inf_code - 1 : all_ones - 1) : inf_code;
    f->up = malloc((f->top + 1) * sizeof(uint32_t));
    /* finite_value of the inf code is 2^(emax - bias): the rounding boundary to inf. */
    for (uint32_t c = 0; c < f->top; c++) {
        double mid = 0.5 * (finite_value(f, c) + finite_value(f, c + 1));
        if ((double)(float)mid != mid) {
            fprintf(stderr, "%s: midpoint %a is not an f32\n", f->name, mid);
            exit(1);
        }
        f->up[c] = bits_of((float)mid) + !(c & 1);
    }
    f->up[f->top] = UINT32_MAX; /* a sentinel: nothing rounds above top */
}

/* The magnitude code of the f32 magnitude bits a (not NaN): how many boundaries lie at or
 * below a (a binary search). */
static uint32_t ref_code(const ref_fmt *f, uint32_t a) {
    uint32_t lo = 0, hi = f->top;
    while (lo < hi) {
        uint32_t c = (lo + hi) / 2;
        if (a < f->up[c]) hi = c;
        else lo = c + 1;
    }
    return lo;
}

/* f32 -> the format, by the definition (NaN by its rule). */
static uint32_t ref_encode(const ref_fmt *f, float x) {
    uint32_t u = bits_of(x);
    if (isnan(x)) return f->nan_rule(u);
    return (u >> 31 ? f->sign_bit : 0) | ref_code(f, u & 0x7FFFFFFF);
}

/* ---------------------------------------------------------------- 1. every f32 */

enum { BLOCK = 1 << 16, NBLOCKS = 1 << 16 };

typedef struct sweep_counts {
    long long kernel[NFMT]; /* ms_cast (AVX2 when present) != portable scalar */
    long long ref[NFMT];    /* portable != definition, non-NaN inputs */
    long long nan[NFMT];    /* NaN input did not give the NaN of the rule */
    long long f16c;         /* portable f16 != _cvtss_sh */
    long long inputs;
} sweep_counts;

typedef struct sweep_job {
    atomic_int next_block;
    pthread_mutex_t lock;
    sweep_counts total;
} sweep_job;

static bool sweep_block_wanted(int b) {
    /* quick: 1 in 61 blocks (an odd stride, so every exponent region is visited), and the
     * blocks around 0 and inf/NaN of both signs. */
    return !quick || b % 61 == 0 || (b & 0x7FFF) == 0 || (b & 0x7FFF) == 0x7F80 || (b & 0x7FFF) == 0x7F7F;
}

#ifdef HAVE_X86
/* The F16C instruction, one element at a time (vcvtps2ph with an xmm of one lane). */
TEST_F16C static void f16c_encode_block(const float *x, uint16_t *out, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) out[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}
TEST_F16C static float f16c_decode(uint16_t h) { return _cvtsh_ss(h); }
#endif

/* The portable scalars on a block (a switch outside the loops: this is the hot part). */
static void portable_block(ms_dtype t, const float *x, uint32_t *out) {
    switch (t) {
    case MS_BF16: for (uint32_t i = 0; i < BLOCK; i++) out[i] = ms__f32_to_bf16(x[i]); break;
    case MS_F16: for (uint32_t i = 0; i < BLOCK; i++) out[i] = ms__f32_to_f16(x[i]); break;
    case MS_F8E4M3: for (uint32_t i = 0; i < BLOCK; i++) out[i] = ms__f32_to_e4m3(x[i]); break;
    case MS_F8E5M2: for (uint32_t i = 0; i < BLOCK; i++) out[i] = ms__f32_to_e5m2(x[i]); break;
    default: abort();
    }
}

static void sweep_one_block(int b, float *x, uint32_t *port, void *out, sweep_counts *n) {
    const uint32_t u0 = (uint32_t)b * BLOCK;
    for (uint32_t i = 0; i < BLOCK; i++) x[i] = float_of(u0 + i);
    for (int f = 0; f < NFMT; f++) {
        const ref_fmt *F = &fmts[f];
        if (ms_cast(out, F->dtype, x, MS_F32, BLOCK) != MS_OK) {
            fprintf(stderr, "ms_cast: %s\n", ms_last_error());
            exit(1);
        }
        long long kernel = 0, ref = 0, nan = 0;
        portable_block(F->dtype, x, port);
        if (ms_dtype_size(F->dtype) == 2)
            for (uint32_t i = 0; i < BLOCK; i++) kernel += ((uint16_t *)out)[i] != port[i];
        else
            for (uint32_t i = 0; i < BLOCK; i++) kernel += ((uint8_t *)out)[i] != port[i];
        /* |x| grows with the bits within a block (one sign): walk the reference code up
         * over the f32 rounding boundaries. */
        const uint32_t sign = u0 >> 31 ? F->sign_bit : 0, *up = F->up;
        uint32_t c = ref_code(F, isnan(x[0]) ? 0 : u0 & 0x7FFFFFFF);
        for (uint32_t i = 0; i < BLOCK; i++) {
            const uint32_t a = (u0 + i) & 0x7FFFFFFF;
            if (a > 0x7F800000) break; /* NaNs: the rest of the block, below */
            while (a >= up[c]) c++;
            ref += port[i] != (sign | c);
        }
        if (isnan(x[BLOCK - 1])) /* NaNs are the top of the block */
            for (uint32_t i = 0; i < BLOCK; i++) nan += isnan(x[i]) && port[i] != F->nan_rule(u0 + i);
        n->kernel[f] += kernel;
        n->ref[f] += ref;
        n->nan[f] += nan;
#ifdef HAVE_X86
        if (F->dtype == MS_F16) {
            uint16_t *hw = out; /* the kernel's output is checked already */
            f16c_encode_block(x, hw, BLOCK);
            for (uint32_t i = 0; i < BLOCK; i++) n->f16c += hw[i] != port[i];
        }
#endif
    }
    n->inputs += BLOCK;
}

static void *sweep_worker(void *arg) {
    sweep_job *job = arg;
    sweep_counts n = {0};
    float *x = malloc(BLOCK * sizeof(float));
    uint32_t *port = malloc(BLOCK * sizeof(uint32_t));
    void *out = malloc(BLOCK * 2);
    for (int b; (b = atomic_fetch_add(&job->next_block, 1)) < NBLOCKS;)
        if (sweep_block_wanted(b)) sweep_one_block(b, x, port, out, &n);
    pthread_mutex_lock(&job->lock);
    for (int f = 0; f < NFMT; f++) {
        job->total.kernel[f] += n.kernel[f];
        job->total.ref[f] += n.ref[f];
        job->total.nan[f] += n.nan[f];
    }
    job->total.f16c += n.f16c;
    job->total.inputs += n.inputs;
    pthread_mutex_unlock(&job->lock);
    free(x);
    free(port);
    free(out);
    return NULL;
}

static void check_every_f32(void) {
    enum { NTHREADS = 2 };
    double t0 = now_s();
    sweep_job job = {.lock = PTHREAD_MUTEX_INITIALIZER};
    atomic_init(&job.next_block, 0);
    set_impl(has_avx2 ? MS_CAST_AVX2 : MS_CAST_PORTABLE);
    pthread_t th[NTHREADS];
    for (int t = 0; t < NTHREADS; t++) pthread_create(&th[t], NULL, sweep_worker, &job);
    for (int t = 0; t < NTHREADS; t++) pthread_join(th[t], NULL);
    printf("1. f32 -> bf16, f16, e4m3, e5m2 on %lld inputs%s (%.1f s)\n", job.total.inputs,
           quick ? " (quick: a subset)" : " (all 2^32)", now_s() - t0);
    char what[128];
    for (int f = 0; f < NFMT; f++) {
        snprintf(what, sizeof what, "f32->%s: %s == portable scalar", fmts[f].name,
                 has_avx2 ? "AVX2 kernel" : "portable kernel");
        report(what, job.total.kernel[f]);
        snprintf(what, sizeof what, "f32->%s: portable == definition (non-NaN)", fmts[f].name);
        report(what, job.total.ref[f]);
        snprintf(what, sizeof what, "f32->%s: NaN inputs -> NaN of the rule", fmts[f].name);
        report(what, job.total.nan[f]);
    }
#ifdef HAVE_X86
    report("f32->f16: portable == F16C _cvtss_sh (all inputs, NaNs too)", job.total.f16c);
#endif
}

/* ---------------------------------------------------------------- 2. every narrow value to f32 */

/* The f32 bits a narrow value must widen to: the definition's value, or for a NaN the NaN
 * with the sign and the payload shifted to the top, quieted except from bf16 (whose rule is
 * the bits shifted, u << 16).  e4m3fn has one NaN and no payload. */
static uint32_t widened_bits(const ref_fmt *f, uint32_t code) {
    double v = f->value[code];
    if (!isnan(v)) return bits_of((float)v);
    uint32_t sign = code & f->sign_bit ? 0x80000000u : 0;
    uint32_t payload = f->ieee ? (code & ((1u << f->mbits) - 1)) << (23 - f->mbits) : 0;
    uint32_t quiet = f->dtype == MS_BF16 ? 0 : 0x400000;
    return sign | 0x7F800000 | quiet | payload;
}

static void check_widening(const ms_cast_impl impls[], int nimpl) {
    printf("2. bf16, f16 (65536 each), e4m3, e5m2 (256 each) -> f32\n");
    float *got = malloc(65536 * sizeof(float));
    uint16_t *c16 = malloc(65536 * sizeof(uint16_t));
    uint8_t c8[256];
    for (int f = 0; f < NFMT; f++) {
        const ref_fmt *F = &fmts[f];
        const uint32_t ncodes = 2 * F->sign_bit;
        for (uint32_t c = 0; c < ncodes; c++) {
            if (ncodes > 256) c16[c] = (uint16_t)c;
            else c8[c] = (uint8_t)c;
        }
        for (int k = 0; k < nimpl; k++) {
            set_impl(impls[k]);
            ms_cast(got, MS_F32, ncodes > 256 ? (void *)c16 : (void *)c8, F->dtype, ncodes);
            long long bad = 0, scalar = 0;
            for (uint32_t c = 0; c < ncodes; c++) {
                bad += bits_of(got[c]) != widened_bits(F, c);
                float s = F->dtype == MS_BF16 ? ms__bf16_to_f32((uint16_t)c)
                        : F->dtype == MS_F16  ? ms__f16_to_f32((uint16_t)c)
                        : F->dtype == MS_F8E4M3 ? ms__e4m3_to_f32((uint8_t)c)
                                                : ms__e5m2_to_f32((uint8_t)c);
                scalar += bits_of(s) != bits_of(got[c]);
            }
            char what[128];
            snprintf(what, sizeof what, "%s->f32 %s: == definition (NaNs by the rule)", F->name,
                     impls[k] == MS_CAST_AVX2 ? "AVX2" : "portable");
            report(what, bad);
            snprintf(what, sizeof what, "%s->f32 %s: == ms__%s_to_f32 scalar", F->name,
                     impls[k] == MS_CAST_AVX2 ? "AVX2" : "portable", F->name);
            report(what, scalar);
        }
    }
#ifdef HAVE_X86
    long long hw = 0;
    for (uint32_t c = 0; c < 65536; c++) hw += bits_of(f16c_decode((uint16_t)c)) != bits_of(ms__f16_to_f32((uint16_t)c));
    report("f16->f32: portable == F16C _cvtsh_ss (all 65536, NaNs too)", hw);
#endif
    free(got);
    free(c16);
}

/* ---------------------------------------------------------------- 3. edge cases */

static void check_edges(const ms_cast_impl impls[], int nimpl) {
    printf("3. edge cases by hand\n");
    static const struct { float x; uint8_t e4m3, e5m2; uint16_t f16; } cases[] = {
        {448.0f, 0x7E, 0x5F, 0x5F00},
        {464.0f, 0x7E, 0x5F, 0x5F40},          /* e4m3: tie 448 | 480, 448 even */
        {480.0f, 0x7E, 0x60, 0x5F80},          /* e4m3: rounds to 480 = NaN code: saturates */
        {-480.0f, 0xFE, 0xE0, 0xDF80},
        {1e9f, 0x7E, 0x7B, 0x7C00},
        {INFINITY, 0x7E, 0x7B, 0x7C00},
        {-INFINITY, 0xFE, 0xFB, 0xFC00},
        {NAN, 0x7F, 0x7E, 0x7E00},
        {-NAN, 0xFF, 0xFE, 0xFE00},
        {0x1p-9f, 0x01, 0x18, 0x1800},         /* smallest e4m3 subnormal */
        {0x1p-10f, 0x00, 0x14, 0x1400},        /* e4m3: tie 0 | 2^-9 -> 0 */
        {-0x1p-10f, 0x80, 0x94, 0x9400},       /* the sign of an underflow is kept */
        {0x1.8p-10f, 0x01, 0x16, 0x1600},
        {0x1p-16f, 0x00, 0x01, 0x0100},        /* smallest e5m2 subnormal */
        {0x1p-17f, 0x00, 0x00, 0x0080},        /* e5m2: tie 0 | 2^-16 -> 0 */
        {0x1p-24f, 0x00, 0x00, 0x0001},        /* smallest f16 subnormal */
        {0x1p-25f, 0x00, 0x00, 0x0000},        /* f16: tie -> 0 */
        {0x1.8p-25f, 0x00, 0x00, 0x0001},
        {57344.0f, 0x7E, 0x7B, 0x7B00},
        {61440.0f, 0x7E, 0x7B, 0x7B80},        /* e5m2: tie 57344 | 65536 (inf): saturates */
        {65504.0f, 0x7E, 0x7B, 0x7BFF},
        {65519.0f, 0x7E, 0x7B, 0x7BFF},
        {65520.0f, 0x7E, 0x7B, 0x7C00},        /* f16: tie 65504 | 65536 -> inf */
        {0.0f, 0x00, 0x00, 0x0000},
        {-0.0f, 0x80, 0x80, 0x8000},
    };
    enum { N = sizeof cases / sizeof cases[0] };
    float x[N];
    uint8_t e4m3[N], e5m2[N];
    uint16_t f16[N];
    for (int i = 0; i < N; i++) x[i] = cases[i].x;
    for (int k = 0; k < nimpl; k++) {
        set_impl(impls[k]);
        ms_cast(e4m3, MS_F8E4M3, x, MS_F32, N);
        ms_cast(e5m2, MS_F8E5M2, x, MS_F32, N);
        ms_cast(f16, MS_F16, x, MS_F32, N);
        long long bad = 0;
        for (int i = 0; i < N; i++) {
            bool ok = e4m3[i] == cases[i].e4m3 && e5m2[i] == cases[i].e5m2 && f16[i] == cases[i].f16;
            if (!ok)
                printf("    %a: e4m3 %02x (want %02x) e5m2 %02x (want %02x) f16 %04x (want %04x)\n",
                       (double)x[i], e4m3[i], cases[i].e4m3, e5m2[i], cases[i].e5m2, f16[i], cases[i].f16);
            bad += !ok;
        }
        char what[128];
        snprintf(what, sizeof what, "%d hand-written fp8/f16 cases, %s", N,
                 impls[k] == MS_CAST_AVX2 ? "AVX2" : "portable");
        report(what, bad);
    }
}

/* ---------------------------------------------------------------- 4. every pair, by the rules */

/* A source element as the rules see it: an integer (integers, bool) or a double (floats). */
typedef struct model_val {
    bool is_int;
    int64_t i;
    double d;
} model_val;

static bool is_int_dtype(ms_dtype t) { return !ms_dtype_is_float(t); }

static model_val model_load(ms_dtype t, const unsigned char *p) {
    model_val v = {is_int_dtype(t), 0, 0};
    ref_fmt *f = fmt_of(t);
    float f32;
    int32_t i32;
    uint16_t u16;
    switch (t) {
    case MS_F32: memcpy(&f32, p, 4); v.d = f32; break;
    case MS_F64: memcpy(&v.d, p, 8); break;
    case MS_F16:
    case MS_BF16: memcpy(&u16, p, 2); v.d = f->value[u16]; break;
    case MS_F8E4M3:
    case MS_F8E5M2: v.d = f->value[*p]; break;
    case MS_I64: memcpy(&v.i, p, 8); break;
    case MS_I32: memcpy(&i32, p, 4); v.i = i32; break;
    case MS_I8: v.i = (int8_t)*p; break;
    case MS_U8: v.i = *p; break;
    case MS_BOOL: v.i = *p != 0; break;
    default: abort();
    }
    return v;
}

static int64_t model_trunc(double x, int64_t lo, int64_t hi) {
    if (isnan(x)) return 0;
    x = trunc(x);
    if (x < (double)lo) return lo;
    if (x >= 0x1p63 || x > (double)hi) return hi; /* (double)INT64_MAX rounds up to 2^63 */
    return (int64_t)x;
}

/* The destination element the rules give for v. */
static void model_store(ms_dtype t, model_val v, unsigned char *p) {
    const float f32 = v.is_int ? (float)v.i : (float)v.d; /* the f32 every narrower float rounds from */
    int64_t i = v.is_int ? v.i : 0;
    double f64 = v.is_int ? (double)v.i : v.d;
    int32_t i32;
    uint16_t u16;
    switch (t) {
    case MS_F32: memcpy(p, &f32, 4); return;
    case MS_F64: memcpy(p, &f64, 8); return;
    case MS_F16:
    case MS_BF16: u16 = (uint16_t)ref_encode(fmt_of(t), f32); memcpy(p, &u16, 2); return;
    case MS_F8E4M3:
    case MS_F8E5M2: *p = (uint8_t)ref_encode(fmt_of(t), f32); return;
    case MS_BOOL: *p = v.is_int ? v.i != 0 : v.d != 0; return;
    default: break;
    }
    switch (t) { /* integers: saturating truncation from floats, then C-cast wrapping */
    case MS_I64: if (!v.is_int) i = model_trunc(v.d, INT64_MIN, INT64_MAX); memcpy(p, &i, 8); return;
    case MS_I32: if (!v.is_int) i = model_trunc(v.d, INT32_MIN, INT32_MAX); i32 = (int32_t)i; memcpy(p, &i32, 4); return;
    case MS_I8: if (!v.is_int) i = model_trunc(v.d, INT8_MIN, INT8_MAX); *p = (uint8_t)(int8_t)i; return;
    case MS_U8: if (!v.is_int) i = model_trunc(v.d, 0, UINT8_MAX); *p = (uint8_t)i; return;
    default: abort();
    }
}

static bool is_nan_elem(ms_dtype t, const unsigned char *p) {
    if (is_int_dtype(t)) return false;
    return isnan(model_load(t, p).d);
}

/* An element's bytes as hex, most significant first (a static buffer: one use per printf). */
static const char *hex(const unsigned char *p, int size) {
    static char buf[2][20];
    static int which;
    char *b = buf[which ^= 1];
    for (int i = 0; i < size; i++) snprintf(b + 2 * i, 3, "%02x", p[size - 1 - i]);
    return b;
}

static void check_pairs(const ms_cast_impl impls[], int nimpl) {
    static const double values[] = {0.0, -0.0, 1.0, -1.5, 2.5, 255.0, 256.0, -129.0, 1e10, -1e10, NAN,
                                    INFINITY, -INFINITY, 0.1, 300.0, 70000.0, 1e-6, 3.0e38, 1e300,
                                    0x1p63, -0x1p63, 4294967295.0, 0x1.000001p24};
    enum { N = sizeof values / sizeof values[0] };
    printf("4. every pair of the %d dtypes on %d values, against a model of the rules\n", MS_DTYPE_COUNT, N);
    unsigned char src[N * 8], dst[N * 8], want[8];
    for (int k = 0; k < nimpl; k++) {
        set_impl(impls[k]);
        long long bad = 0, pairs = 0;
        for (int s = 0; s < MS_DTYPE_COUNT; s++) {
            const int ss = ms_dtype_size((ms_dtype)s);
            for (int i = 0; i < N; i++) model_store((ms_dtype)s, (model_val){false, 0, values[i]}, src + i * ss);
            for (int d = 0; d < MS_DTYPE_COUNT; d++) {
                const int ds = ms_dtype_size((ms_dtype)d);
                pairs++;
                if (ms_cast(dst, (ms_dtype)d, src, (ms_dtype)s, N) != MS_OK) {
                    bad++;
                    continue;
                }
                for (int i = 0; i < N; i++) {
                    model_store((ms_dtype)d, model_load((ms_dtype)s, src + i * ss), want);
                    bool ok = is_nan_elem((ms_dtype)d, want) ? is_nan_elem((ms_dtype)d, dst + i * ds)
                                                             : memcmp(want, dst + i * ds, (size_t)ds) == 0;
                    if (!ok && bad < 10)
                        printf("    %s -> %s, value %g: got %s, want %s\n", ms_dtype_name((ms_dtype)s),
                               ms_dtype_name((ms_dtype)d), values[i], hex(dst + i * ds, ds), hex(want, ds));
                    bad += !ok;
                }
            }
        }
        char what[128];
        snprintf(what, sizeof what, "%lld pairs x %d values, %s", pairs, N,
                 impls[k] == MS_CAST_AVX2 ? "AVX2" : "portable");
        report(what, bad);
    }
}

/* ---------------------------------------------------------------- 5. lengths, alignment, in place */

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rng_next(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void fill_random(unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i += 8) {
        uint64_t r = rng_next();
        memcpy(p + i, &r, n - i < 8 ? n - i : 8);
    }
}

enum { GUARD = 64, GUARD_BYTE = 0xA5 };

/* Casts n random elements from src + soff bytes to dst + doff bytes, then compares with the
 * same cast done in pieces into an aligned buffer (pieces of 1 element never reach a vector
 * step; pieces of 4099 stay below the streaming size and start aligned) and checks the
 * guard bytes around dst.  Returns the count of wrong elements and guard bytes. */
static long long check_one_length(ms_dtype s, ms_dtype d, int64_t n, int soff, int doff) {
    const int ss = ms_dtype_size(s), ds = ms_dtype_size(d);
    const int64_t piece = n <= 1003 ? 1 : 4099;
    unsigned char *src = malloc((size_t)(n * ss + GUARD));
    unsigned char *dst = malloc((size_t)(n * ds + 2 * GUARD));
    unsigned char *want = malloc((size_t)(n * ds + 1));
    fill_random(src + soff, (size_t)(n * ss));
    memset(dst, GUARD_BYTE, (size_t)(n * ds + 2 * GUARD));
    long long bad = ms_cast(dst + GUARD + doff, d, src + soff, s, n) != MS_OK;
    for (int64_t i = 0; i < n; i += piece)
        ms_cast(want + i * ds, d, src + soff + i * ss, s, n - i < piece ? n - i : piece);
    if (memcmp(want, dst + GUARD + doff, (size_t)(n * ds)) != 0)
        for (int64_t i = 0; i < n; i++) bad += memcmp(want + i * ds, dst + GUARD + doff + i * ds, (size_t)ds) != 0;
    for (int64_t b = 0; b < GUARD + doff; b++) bad += dst[b] != GUARD_BYTE;
    for (int64_t b = GUARD + doff + n * ds; b < n * ds + 2 * GUARD; b++) bad += dst[b] != GUARD_BYTE;
    free(src);
    free(dst);
    free(want);
    return bad;
}

static bool is_kernel_pair(ms_dtype s, ms_dtype d) {
    return (s == MS_F32 && fmt_of(d)) || (d == MS_F32 && fmt_of(s));
}

static void check_lengths(const ms_cast_impl impls[], int nimpl) {
    static const int64_t small[] = {0, 1, 7, 31, 32, 33, 1003};
    /* 8 MiB of output and more is written with streaming stores (cast.c MS_STREAM_BYTES). */
    const int64_t large[] = {1000003, (8 << 20) + 37};
    printf("5. lengths %s, offsets 0 / 1 element / 1 byte, guard bytes, in place\n",
           quick ? "0..1003 and 1000003" : "0..1003, 1000003 and 8Mi+37");
    for (int k = 0; k < nimpl; k++) {
        set_impl(impls[k]);
        long long bad = 0, runs = 0;
        for (int s = 0; s < MS_DTYPE_COUNT; s++)
            for (int d = 0; d < MS_DTYPE_COUNT; d++) {
                const int offs[][2] = {{0, 0}, {ms_dtype_size((ms_dtype)s), ms_dtype_size((ms_dtype)d)}, {1, 3}};
                for (int o = 0; o < 3; o++) {
                    for (size_t l = 0; l < sizeof small / sizeof small[0]; l++, runs++)
                        bad += check_one_length((ms_dtype)s, (ms_dtype)d, small[l], offs[o][0], offs[o][1]);
                    /* Long runs for the vector kernels and a staged pair on each side. */
                    bool long_runs = is_kernel_pair((ms_dtype)s, (ms_dtype)d) ||
                                     (s == MS_BF16 && d == MS_F16) || (s == MS_F64 && d == MS_F8E4M3);
                    for (int l = 0; long_runs && l < (quick ? 1 : 2); l++, runs++)
                        bad += check_one_length((ms_dtype)s, (ms_dtype)d, large[l], offs[o][0], offs[o][1]);
                }
            }
        char what[128];
        snprintf(what, sizeof what, "%lld runs: one call == the same in pieces, guards, %s", runs,
                 impls[k] == MS_CAST_AVX2 ? "AVX2" : "portable");
        report(what, bad);

        /* In place, wherever the element sizes are equal: the same bytes as out of place. */
        long long inplace_bad = 0, inplace_pairs = 0;
        const int64_t n = 100003;
        unsigned char *buf = malloc(n * 8), *out = malloc(n * 8);
        for (int s = 0; s < MS_DTYPE_COUNT; s++)
            for (int d = 0; d < MS_DTYPE_COUNT; d++) {
                if (ms_dtype_size((ms_dtype)s) != ms_dtype_size((ms_dtype)d)) continue;
                inplace_pairs++;
                fill_random(buf, (size_t)(n * 8));
                ms_cast(out, (ms_dtype)d, buf, (ms_dtype)s, n);
                inplace_bad += ms_cast(buf, (ms_dtype)d, buf, (ms_dtype)s, n) != MS_OK;
                inplace_bad += memcmp(out, buf, (size_t)(n * ms_dtype_size((ms_dtype)d))) != 0;
            }
        free(buf);
        free(out);
        snprintf(what, sizeof what, "%lld in-place pairs (dst == src) == out of place, %s", inplace_pairs,
                 impls[k] == MS_CAST_AVX2 ? "AVX2" : "portable");
        report(what, inplace_bad);
    }
}

/* ---------------------------------------------------------------- 6. errors */

static long long expect_error(ms_status got, ms_status want, const char *needle) {
    bool ok = got == want && strstr(ms_last_error(), needle) != NULL;
    if (!ok)
        printf("    want %s containing '%s', got %s '%s'\n", ms_status_name(want), needle, ms_status_name(got),
               ms_last_error());
    return !ok;
}

static void check_errors(void) {
    printf("6. argument errors\n");
    float f[4] = {1, 2, 3, 4};
    uint16_t h[4];
    long long bad = 0;
    bad += expect_error(ms_cast(NULL, MS_BF16, f, MS_F32, 4), MS_ERR_ARG, "dst is NULL");
    bad += expect_error(ms_cast(h, MS_BF16, NULL, MS_F32, 4), MS_ERR_ARG, "src is NULL");
    bad += expect_error(ms_cast(h, MS_BF16, f, MS_F32, -1), MS_ERR_ARG, "negative element count -1");
    bad += expect_error(ms_cast(h, MS_BF16, f, (ms_dtype)42, 4), MS_ERR_ARG, "invalid source dtype 42");
    bad += expect_error(ms_cast(h, (ms_dtype)-1, f, MS_F32, 4), MS_ERR_ARG, "invalid destination dtype -1");
    bad += expect_error(ms_cast(f, MS_BF16, f, MS_F32, 4), MS_ERR_ARG, "f32 (4 bytes) -> bf16 (2 bytes)");
    bad += expect_error(ms_cast(h, MS_BF16, f, MS_F32, INT64_MAX / 2), MS_ERR_OVERFLOW, "overflow");
    bad += expect_error(ms_cast_set_impl((ms_cast_impl)7), MS_ERR_ARG, "unknown impl 7");
    bad += expect_error(ms_cast(NULL, MS_BF16, NULL, MS_F32, 0), MS_OK, "");
    bad += ms_last_error()[0] != '\0';
    bad += expect_error(ms_cast_set_impl(MS_CAST_AUTO), MS_OK, "");
    bad += ms_cast_get_impl() != (has_avx2 ? MS_CAST_AVX2 : MS_CAST_PORTABLE);
    if (has_avx2) bad += expect_error(ms_cast_set_impl(MS_CAST_AVX2), MS_OK, "");
    else bad += expect_error(ms_cast_set_impl(MS_CAST_AVX2), MS_ERR_NOT_BUILT, "AVX2");
    report("statuses and messages", bad);
}

/* ---------------------------------------------------------------- main */

int main(void) {
    const char *q = getenv("MOONSHARD_TEST_QUICK");
    quick = q && *q && strcmp(q, "0") != 0;
    has_avx2 = ms_cast_set_impl(MS_CAST_AVX2) == MS_OK;
    const ms_cast_impl impls[] = {MS_CAST_PORTABLE, MS_CAST_AVX2};
    const int nimpl = has_avx2 ? 2 : 1;
    if (!has_avx2) printf("NOTICE: no AVX2 + F16C on this CPU: the AVX2 path is not checked\n");
#ifndef HAVE_X86
    printf("NOTICE: not x86-64: the F16C comparisons are skipped\n");
#endif
    for (int f = 0; f < NFMT; f++) ref_init(&fmts[f]);
    double t0 = now_s();
    check_every_f32();
    check_widening(impls, nimpl);
    check_edges(impls, nimpl);
    check_pairs(impls, nimpl);
    check_lengths(impls, nimpl);
    check_errors();
    for (int f = 0; f < NFMT; f++) {
        free(fmts[f].value);
        free(fmts[f].up);
    }
    printf("test_cast: %s (%d failed checks, %.1f s)\n", failures ? "FAIL" : "ok", failures, now_s() - t0);
    return failures ? 1 : 0;
}
