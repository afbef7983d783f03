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
 *  7. against PyTorch's `.to()` as measured by tests/reference/casts.py into
 *     tests/reference/data/casts.txt (the versions are in its header): part 1's sweep also
 *     folds ms_cast's output into the script's per-chunk digests and decodes its exact fp8
 *     outputs; part 7 compares the raw samples around the hard places, f64 -> the narrow
 *     floats (double-rounding cases included), every narrow value -> f32, and the integer
 *     and bool casts.  The README's stated differences (torch_diffs) are checked to hold on
 *     exactly the inputs it names.
 *
 * MOONSHARD_TEST_QUICK=1 sweeps 1 block in 61 of part 1 (for sanitizer builds) and the whole
 * chunks of TORCH_QUICK_CHUNKS for the torch comparisons.
 * Prints each check with its mismatch count; exits 1 when any count is not 0.
 */
#include "ms_internal.h"
#include "refdata.h"

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

/* ---------------------------------------------------------------- PyTorch, as measured */

static refdata *casts_ref;    /* tests/reference/data/casts.txt */
static char torch_name[32];   /* "torch 2.15.0", from its torch_version record */

/* The digest of casts.py (its docstring defines it): a chunk's output codes o_0 .. o_{n-1}
 * folded h = h * P + o_i mod 2^64, i.e. h = sum o_i * P^(n-1-i), with the output for a NaN
 * input taken as the all-ones code when it is a NaN.  P is odd, so every P^k is a unit mod
 * 2^64: one changed output always changes the digest.  The sum form lets each block fold its
 * own outputs and be added in at its place, P^(BLOCK * blocks after it), in any order. */
#define DIGEST_P 0x9E3779B97F4A7C15ull
enum { TORCH_CHUNK = 1 << 24, TORCH_NCHUNKS = 256 };

static uint64_t pow_p(uint64_t e) {
    uint64_t r = 1, b = DIGEST_P;
    for (; e; e >>= 1, b *= b)
        if (e & 1) r *= b;
    return r;
}

/* h = h * P + o[i] over n codes (n a multiple of 4), as four interleaved folds by P^4 so
 * that the multiplies do not wait on each other. */
static uint64_t fold_codes(const uint32_t *o, uint32_t n) {
    const uint64_t p = DIGEST_P, p4 = p * p * p * p;
    uint64_t h0 = 0, h1 = 0, h2 = 0, h3 = 0;
    for (uint32_t i = 0; i < n; i += 4) {
        h0 = h0 * p4 + o[i];
        h1 = h1 * p4 + o[i + 1];
        h2 = h2 * p4 + o[i + 2];
        h3 = h3 * p4 + o[i + 3];
    }
    return ((h0 * p + h1) * p + h2) * p + h3;
}

/* The differences from PyTorch that the README states: inputs of magnitude bits lo..hi (of
 * the f32 that is rounded) where moonshard gives sign | ms_code and torch sign | torch_code.
 * The torch comparisons take torch's code there when moonshard gives its own, and count the
 * inputs: the count must be every input of the range, or moonshard no longer does what the
 * README says.  e4m3fn, bf16 and f16 have none: torch saturates e4m3fn as moonshard does. */
typedef struct torch_diff {
    int fmt;
    uint32_t lo, hi, ms_code, torch_code;
    const char *what;
} torch_diff;

static const torch_diff torch_diffs[] = {
    {E5M2, 0x47700000, 0x7F800000, 0x7B, 0x7C, "|x| >= 61440, inf too: torch +-inf, moonshard +-57344"},
};
enum { NDIFFS = sizeof torch_diffs / sizeof torch_diffs[0] };

/* Whole chunks compared under MOONSHARD_TEST_QUICK (5 of 256, the added time of a sanitizer
 * build in mind): where the formats' hard places are.  0x3B: 2^-9 .. 2^-7, e4m3's subnormals;
 * 0x47: 32768 .. 131072, e5m2's 57344 and 61440 (the README's difference), f16's 65504 and
 * 65520; 0x7F: bf16's largest, inf and the NaNs; 0xB7: -2^-17 .. -2^-15, f16's and e5m2's
 * subnormals; 0xC3: -128 .. -512, e4m3's -448, -464, -480. */
static const int TORCH_QUICK_CHUNKS[] = {0x3B, 0x47, 0x7F, 0xB7, 0xC3};

static bool torch_chunk_wanted(int c) {
    if (!quick) return true;
    for (size_t i = 0; i < sizeof TORCH_QUICK_CHUNKS / sizeof TORCH_QUICK_CHUNKS[0]; i++)
        if (TORCH_QUICK_CHUNKS[i] == c) return true;
    return false;
}

/* ---------------------------------------------------------------- 1. every f32 */

enum { BLOCK = 1 << 16, NBLOCKS = 1 << 16, BLOCKS_PER_CHUNK = TORCH_CHUNK / BLOCK };

/* Against torch, per path: PORT the portable scalars, KERN ms_cast's kernel (AVX2 when
 * present).  Part 1 checks that the two agree anyway; comparing both with torch names the
 * one that moved. */
enum { PORT, KERN };

/* The first input whose expected output differs from torch's exact fp8 output. */
typedef struct torch_first {
    uint64_t u; /* UINT64_MAX: none */
    uint32_t torch, want;
} torch_first;

typedef struct sweep_counts {
    long long kernel[NFMT]; /* ms_cast (AVX2 when present) != portable scalar */
    long long ref[NFMT];    /* portable != definition, non-NaN inputs */
    long long nan[NFMT];    /* NaN input did not give the NaN of the rule */
    long long f16c;         /* portable f16 != _cvtss_sh */
    long long inputs;
    /* against torch, over the chunks torch_chunk_wanted */
    uint64_t digest[2][NFMT][TORCH_NCHUNKS]; /* each block's fold, placed (see fold_codes) */
    long long diff_range[2][NDIFFS];         /* inputs in a torch_diffs range */
    long long diff_applied[2][NDIFFS];       /* ... where moonshard gave its documented code */
    long long runs_bad[2][NFMT];             /* fp8: inputs whose output != torch's exact one */
    torch_first runs_first[2][NFMT];
} sweep_counts;

typedef struct sweep_job {
    atomic_int next_block;
    pthread_mutex_t lock;
    sweep_counts total;
} sweep_job;

static void sweep_counts_init(sweep_counts *n) {
    memset(n, 0, sizeof *n);
    for (int p = 0; p < 2; p++)
        for (int f = 0; f < NFMT; f++) n->runs_first[p][f].u = UINT64_MAX;
}

static bool sweep_block_wanted(int b) {
    /* quick: 1 in 61 blocks (an odd stride, so every exponent region is visited), and the
     * blocks around 0 and inf/NaN of both signs. */
    return !quick || b % 61 == 0 || (b & 0x7FFF) == 0 || (b & 0x7FFF) == 0x7F80 || (b & 0x7FFF) == 0x7F7F;
}

/* torch's data for the sweep, from casts.txt (torch_load). */
static const refrec *torch_digest[NFMT];              /* f32_<t>_digest: 256 chunks */
static const refrec *torch_run_start[NFMT], *torch_run_code[NFMT]; /* fp8 only */
static uint64_t block_place[BLOCKS_PER_CHUNK];        /* P^(BLOCK * blocks after block k) */

static bool is_nan_code(const ref_fmt *F, uint32_t c) { return isnan(F->value[c]); }

/* Whether expect_torch_block has anything to change in the block of inputs from u0. */
static bool block_needs_expect(int f, uint32_t u0) {
    const uint32_t a0 = u0 & 0x7FFFFFFF, a1 = a0 + (BLOCK - 1);
    if (a1 > 0x7F800000) return true;
    for (int d = 0; d < NDIFFS; d++)
        if (torch_diffs[d].fmt == f && a1 >= torch_diffs[d].lo && a0 <= torch_diffs[d].hi) return true;
    return false;
}

/* Turns moonshard's codes for the block of inputs from u0 into torch's output as the README
 * predicts it, in place: the output for a NaN input becomes the all-ones code when it is a
 * NaN (the digests' rule), and torch_diffs apply where moonshard gives its documented code.
 * Adds each difference's inputs in the block to range[] and those changed to applied[]. */
static void expect_torch_block(int f, uint32_t u0, uint32_t *o, long long range[], long long applied[]) {
    const ref_fmt *F = &fmts[f];
    const uint32_t a0 = u0 & 0x7FFFFFFF, a1 = a0 + (BLOCK - 1), sign = u0 >> 31 ? F->sign_bit : 0;
    if (a1 > 0x7F800000) /* NaN inputs are the top of a block */
        for (uint32_t i = a0 > 0x7F800000 ? 0 : 0x7F800001 - a0; i < BLOCK; i++)
            if (is_nan_code(F, o[i])) o[i] = 2 * F->sign_bit - 1;
    for (int d = 0; d < NDIFFS; d++) {
        const torch_diff *D = &torch_diffs[d];
        if (D->fmt != f || a1 < D->lo || a0 > D->hi) continue;
        const uint32_t i0 = D->lo > a0 ? D->lo - a0 : 0, i1 = D->hi < a1 ? D->hi - a0 : BLOCK - 1;
        const uint32_t ms = sign | D->ms_code, torch = sign | D->torch_code;
        long long changed = 0;
        for (uint32_t i = i0; i <= i1; i++) {
            const bool hit = o[i] == ms;
            o[i] = hit ? torch : o[i];
            changed += hit;
        }
        range[d] += i1 - i0 + 1;
        applied[d] += changed;
    }
}

/* Compares the expected codes of the block of inputs from u0 with torch's exact fp8 output,
 * decoded from its runs (the run holding u0 found by bisection; a block spans one or two). */
static void runs_block(int f, uint32_t u0, const uint32_t *want, long long *bad, torch_first *first) {
    const ref_fmt *F = &fmts[f];
    const refrec *st = torch_run_start[f], *cd = torch_run_code[f];
    int64_t r = 0, hi = st->n - 1; /* the last run that starts at or before u0 */
    while (r < hi) {
        int64_t mid = (r + hi + 1) / 2;
        if (st->v[mid] <= u0) r = mid;
        else hi = mid - 1;
    }
    const uint32_t a0 = u0 & 0x7FFFFFFF;
    const uint32_t nan_from = a0 > 0x7F800000 ? 0 : a0 + (BLOCK - 1) > 0x7F800000 ? 0x7F800001 - a0 : BLOCK;
    const uint64_t end = (uint64_t)u0 + BLOCK;
    for (; r < st->n && st->v[r] < end; r++) {
        const uint32_t i0 = st->v[r] > u0 ? (uint32_t)(st->v[r] - u0) : 0;
        const uint32_t i1 = r + 1 < st->n && st->v[r + 1] < end ? (uint32_t)(st->v[r + 1] - u0) : BLOCK;
        const uint32_t code = (uint32_t)cd->v[r];
        /* the inputs below nan_from, then the NaN inputs (whose NaN output is all ones) */
        for (int nan_part = 0; nan_part < 2; nan_part++) {
            const uint32_t j0 = nan_part && i0 < nan_from ? nan_from : i0;
            const uint32_t j1 = !nan_part && i1 > nan_from ? nan_from : i1;
            const uint32_t t = nan_part && is_nan_code(F, code) ? 2 * F->sign_bit - 1 : code;
            long long b = 0;
            for (uint32_t i = j0; i < j1; i++) b += want[i] != t;
            if (!b) continue;
            *bad += b;
            uint32_t i = j0;
            while (want[i] == t) i++;
            if (u0 + i < first->u) *first = (torch_first){u0 + i, code, want[i]};
        }
    }
}

/* One path's torch comparisons of one format on a block: its fold placed in the chunk's
 * digest, the README's differences, the fp8 runs. */
typedef struct torch_result {
    uint64_t placed;
    long long range[NDIFFS], applied[NDIFFS], runs_bad;
    torch_first first;
} torch_result;

/* The comparisons of the codes of the block of inputs from u0 (expected torch output made in
 * `scratch` when the block needs it; scratch may be codes itself). */
static torch_result torch_compare_block(int f, uint32_t u0, const uint32_t *codes, uint32_t *scratch) {
    torch_result r = {.first = {UINT64_MAX, 0, 0}};
    if (block_needs_expect(f, u0)) {
        if (scratch != codes) memcpy(scratch, codes, BLOCK * sizeof *scratch);
        expect_torch_block(f, u0, scratch, r.range, r.applied);
        codes = scratch;
    }
    r.placed = fold_codes(codes, BLOCK) * block_place[u0 % TORCH_CHUNK / BLOCK];
    if (torch_run_start[f]) runs_block(f, u0, codes, &r.runs_bad, &r.first);
    return r;
}

static void torch_add(sweep_counts *n, int path, int f, uint32_t u0, const torch_result *r) {
    n->digest[path][f][u0 / TORCH_CHUNK] += r->placed;
    for (int d = 0; d < NDIFFS; d++) {
        n->diff_range[path][d] += r->range[d];
        n->diff_applied[path][d] += r->applied[d];
    }
    n->runs_bad[path][f] += r->runs_bad;
    if (r->first.u < n->runs_first[path][f].u) n->runs_first[path][f] = r->first;
}

/* The torch comparisons of one format on the block of inputs from u0: port is the portable
 * scalars' output, out ms_cast's (kernel_differs: they are not the same); want and kern are
 * scratch blocks. */
static void torch_block(int f, uint32_t u0, const uint32_t *port, const void *out, bool kernel_differs,
                        uint32_t *want, uint32_t *kern, sweep_counts *n) {
    const torch_result r = torch_compare_block(f, u0, port, want);
    torch_add(n, PORT, f, u0, &r);
    if (!kernel_differs) { /* the same outputs: the same results */
        torch_add(n, KERN, f, u0, &r);
        return;
    }
    if (ms_dtype_size(fmts[f].dtype) == 2)
        for (uint32_t i = 0; i < BLOCK; i++) kern[i] = ((const uint16_t *)out)[i];
    else
        for (uint32_t i = 0; i < BLOCK; i++) kern[i] = ((const uint8_t *)out)[i];
    const torch_result rk = torch_compare_block(f, u0, kern, kern);
    torch_add(n, KERN, f, u0, &rk);
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

/* Scratch blocks of a sweep thread. */
typedef struct sweep_bufs {
    float *x;
    uint32_t *port, *want, *kern;
    void *out;
} sweep_bufs;

/* Part 1's checks on block b when `full`, and the torch comparisons when `torch` (in quick
 * mode the torch chunks are swept whole, most of their blocks for torch alone). */
static void sweep_one_block(int b, bool full, bool torch, const sweep_bufs *buf, sweep_counts *n) {
    const uint32_t u0 = (uint32_t)b * BLOCK;
    float *x = buf->x;
    uint32_t *port = buf->port;
    void *out = buf->out;
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
        if (torch) torch_block(f, u0, port, out, kernel != 0, buf->want, buf->kern, n);
        if (!full) continue;
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
    n->inputs += full ? BLOCK : 0;
}

static void *sweep_worker(void *arg) {
    sweep_job *job = arg;
    sweep_counts *n = malloc(sizeof *n);
    sweep_counts_init(n);
    sweep_bufs buf = {malloc(BLOCK * sizeof(float)), malloc(BLOCK * sizeof(uint32_t)), malloc(BLOCK * sizeof(uint32_t)),
                      malloc(BLOCK * sizeof(uint32_t)), malloc(BLOCK * 2)};
    for (int b; (b = atomic_fetch_add(&job->next_block, 1)) < NBLOCKS;) {
        const bool full = sweep_block_wanted(b), torch = torch_chunk_wanted(b / BLOCKS_PER_CHUNK);
        if (full || torch) sweep_one_block(b, full, torch, &buf, n);
    }
    pthread_mutex_lock(&job->lock);
    sweep_counts *t = &job->total;
    for (int f = 0; f < NFMT; f++) {
        t->kernel[f] += n->kernel[f];
        t->ref[f] += n->ref[f];
        t->nan[f] += n->nan[f];
        for (int p = 0; p < 2; p++) {
            for (int c = 0; c < TORCH_NCHUNKS; c++) t->digest[p][f][c] += n->digest[p][f][c];
            t->runs_bad[p][f] += n->runs_bad[p][f];
            if (n->runs_first[p][f].u < t->runs_first[p][f].u) t->runs_first[p][f] = n->runs_first[p][f];
        }
    }
    for (int p = 0; p < 2; p++)
        for (int d = 0; d < NDIFFS; d++) {
            t->diff_range[p][d] += n->diff_range[p][d];
            t->diff_applied[p][d] += n->diff_applied[p][d];
        }
    t->f16c += n->f16c;
    t->inputs += n->inputs;
    pthread_mutex_unlock(&job->lock);
    free(buf.x);
    free(buf.port);
    free(buf.want);
    free(buf.kern);
    free(buf.out);
    free(n);
    return NULL;
}

/* The torch lines of part 1: per format and path, the chunks whose digests differ (each
 * named with its inputs), the fp8 outputs that differ from torch's exact ones (the first
 * named), and whether the README's differences cover exactly their ranges. */
static void report_torch_sweep(const sweep_counts *t) {
    const char *paths[2] = {"portable scalar", has_avx2 ? "AVX2 kernel" : "portable kernel"};
    int chunks = 0;
    for (int c = 0; c < TORCH_NCHUNKS; c++) chunks += torch_chunk_wanted(c);
    char what[160], inputs[32];
    if (quick) snprintf(inputs, sizeof inputs, "%d x 2^24 inputs", chunks);
    else snprintf(inputs, sizeof inputs, "2^32 inputs");
    for (int f = 0; f < NFMT; f++)
        for (int p = 0; p < 2; p++) {
            long long bad = 0;
            for (int c = 0; c < TORCH_NCHUNKS; c++) {
                if (!torch_chunk_wanted(c) || t->digest[p][f][c] == torch_digest[f]->v[c]) continue;
                if (bad++ < 4)
                    printf("    f32->%s %s: chunk %02x (inputs %08x..%08x, %g .. %g) digest %016" PRIx64
                           ", torch's %016" PRIx64 "\n",
                           fmts[f].name, paths[p], c, (uint32_t)c << 24, ((uint32_t)c << 24) | 0xFFFFFF,
                           (double)float_of((uint32_t)c << 24), (double)float_of(((uint32_t)c << 24) | 0xFFFFFF),
                           t->digest[p][f][c], torch_digest[f]->v[c]);
            }
            snprintf(what, sizeof what, "f32->%s vs %s, %s: %d of 256 chunks (%s) by digest", fmts[f].name, torch_name,
                     paths[p], chunks, inputs);
            report(what, bad);
            if (!torch_run_start[f]) continue;
            const torch_first *first = &t->runs_first[p][f];
            if (first->u != UINT64_MAX)
                printf("    f32->%s %s: first differing input %08" PRIx64 " (%a): torch %02x, moonshard %02x"
                       " (a NaN for a NaN input as ff)\n",
                       fmts[f].name, paths[p], first->u, (double)float_of((uint32_t)first->u), first->torch,
                       first->want);
            snprintf(what, sizeof what, "f32->%s vs %s, %s: exact output (runs), %s", fmts[f].name, torch_name,
                     paths[p], inputs);
            report(what, t->runs_bad[p][f]);
        }
    for (int d = 0; d < NDIFFS; d++)
        for (int p = 0; p < 2; p++) {
            snprintf(what, sizeof what, "f32->%s vs %s, %s: the README's difference on %lld inputs, %s",
                     fmts[torch_diffs[d].fmt].name, torch_name, paths[p], t->diff_range[p][d], torch_diffs[d].what);
            report(what, t->diff_range[p][d] - t->diff_applied[p][d]);
        }
}

static void check_every_f32(void) {
    enum { NTHREADS = 2 };
    double t0 = now_s();
    sweep_job *job = malloc(sizeof *job);
    sweep_counts_init(&job->total);
    pthread_mutex_init(&job->lock, NULL);
    atomic_init(&job->next_block, 0);
    set_impl(has_avx2 ? MS_CAST_AVX2 : MS_CAST_PORTABLE);
    pthread_t th[NTHREADS];
    for (int t = 0; t < NTHREADS; t++) pthread_create(&th[t], NULL, sweep_worker, job);
    for (int t = 0; t < NTHREADS; t++) pthread_join(th[t], NULL);
    printf("1. f32 -> bf16, f16, e4m3, e5m2 on %lld inputs%s (%.1f s)\n", job->total.inputs,
           quick ? " (quick: a subset)" : " (all 2^32)", now_s() - t0);
    char what[128];
    for (int f = 0; f < NFMT; f++) {
        snprintf(what, sizeof what, "f32->%s: %s == portable scalar", fmts[f].name,
                 has_avx2 ? "AVX2 kernel" : "portable kernel");
        report(what, job->total.kernel[f]);
        snprintf(what, sizeof what, "f32->%s: portable == definition (non-NaN)", fmts[f].name);
        report(what, job->total.ref[f]);
        snprintf(what, sizeof what, "f32->%s: NaN inputs -> NaN of the rule", fmts[f].name);
        report(what, job->total.nan[f]);
    }
#ifdef HAVE_X86
    report("f32->f16: portable == F16C _cvtss_sh (all inputs, NaNs too)", job->total.f16c);
#endif
    report_torch_sweep(&job->total);
    pthread_mutex_destroy(&job->lock);
    free(job);
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

/* ---------------------------------------------------------------- 7. PyTorch, the rest */

/* A record of casts.txt with the count the test expects (-1: any). */
static const refrec *torch_rec(const char *name, int64_t n) {
    const refrec *r = refdata_find(casts_ref, name);
    if (!r) {
        fprintf(stderr, "%s: no record %s (tests/reference/casts.py writes it: tests/reference/make.sh casts)\n",
                casts_ref->path, name);
        exit(2);
    }
    if (n >= 0 && r->n != n) {
        fprintf(stderr, "%s: record %s has %lld values, expected %lld (tests/reference/make.sh casts remakes it)\n",
                casts_ref->path, name, (long long)r->n, (long long)n);
        exit(2);
    }
    return r;
}

static const refrec *torch_recf(int64_t n, const char *fmt, const char *a, const char *b) {
    char name[96];
    snprintf(name, sizeof name, fmt, a, b);
    return torch_rec(name, n);
}

/* Loads casts.txt and what the sweep reads of it. */
static void torch_load(void) {
    casts_ref = refdata_load("casts.txt");
    const refrec *v = refdata_get(casts_ref, "torch_version");
    if (v->n != 3) {
        fprintf(stderr, "%s: torch_version has %lld values, expected 3 (major minor patch)\n", casts_ref->path,
                (long long)v->n);
        exit(2);
    }
    snprintf(torch_name, sizeof torch_name, "torch %lld.%lld.%lld", (long long)v->v[0], (long long)v->v[1],
             (long long)v->v[2]);
    for (int f = 0; f < NFMT; f++) {
        torch_digest[f] = torch_recf(TORCH_NCHUNKS, "f32_%s_digest", fmts[f].name, "");
        if (ms_dtype_size(fmts[f].dtype) != 1) continue;
        torch_run_start[f] = torch_recf(-1, "f32_%s_run_start", fmts[f].name, "");
        torch_run_code[f] = torch_recf(torch_run_start[f]->n, "f32_%s_run_code", fmts[f].name, "");
        const refrec *st = torch_run_start[f];
        bool ok = st->n > 0 && st->v[0] == 0;
        for (int64_t r = 1; r < st->n; r++) ok = ok && st->v[r] > st->v[r - 1] && st->v[r] <= UINT32_MAX;
        if (!ok) {
            fprintf(stderr, "%s: f32_%s_run_start must start at 0 and increase\n", casts_ref->path, fmts[f].name);
            exit(2);
        }
    }
    for (int k = 0; k < BLOCKS_PER_CHUNK; k++) block_place[k] = pow_p((uint64_t)BLOCK * (BLOCKS_PER_CHUNK - 1 - k));
}

static const char *impl_name(ms_cast_impl impl) { return impl == MS_CAST_AVX2 ? "AVX2" : "portable"; }

/* Whether moonshard's code ms stands for torch's code t, for an input whose f32 (the value
 * rounded to f32, the hub every narrow float goes through; NaN for a NaN input) has the bits
 * u: both NaN for a NaN input (counted in *nan_bits when the bits differ); in a torch_diffs
 * range, the two codes it names (counted in *documented); else equal. */
static bool torch_agrees(int f, uint32_t u, uint32_t ms, uint32_t t, long long *documented, long long *nan_bits) {
    const ref_fmt *F = &fmts[f];
    const uint32_t a = u & 0x7FFFFFFF, sign = u >> 31 ? F->sign_bit : 0;
    if (a > 0x7F800000 && is_nan_code(F, ms) && is_nan_code(F, t)) {
        *nan_bits += ms != t;
        return true;
    }
    for (int d = 0; d < NDIFFS; d++) {
        const torch_diff *D = &torch_diffs[d];
        if (D->fmt == f && a >= D->lo && a <= D->hi) {
            const bool ok = ms == (sign | D->ms_code) && t == (sign | D->torch_code);
            *documented += ok;
            return ok;
        }
    }
    return ms == t;
}

static uint32_t code_at(const void *p, int size, int64_t i) {
    return size == 2 ? ((const uint16_t *)p)[i] : size == 1 ? ((const uint8_t *)p)[i] : ((const uint32_t *)p)[i];
}

/* What the README's differences and NaN bits add to a line, or "". */
static const char *torch_notes(long long documented, long long nan_bits) {
    static char buf[96];
    buf[0] = '\0';
    if (documented) snprintf(buf, sizeof buf, ", %lld by the README's difference", documented);
    if (nan_bits)
        snprintf(buf + strlen(buf), sizeof buf - strlen(buf), ", %lld NaNs with other bits than torch's", nan_bits);
    return buf;
}

/* 7a. f32 -> each narrow float on the samples around the hard places, values printed. */
static void check_torch_samples(const ms_cast_impl impls[], int nimpl) {
    for (int f = 0; f < NFMT; f++) {
        const refrec *in = torch_recf(-1, "f32_%s_sample_in", fmts[f].name, "");
        const refrec *want = torch_recf(in->n, "f32_%s_sample_out", fmts[f].name, "");
        const int size = ms_dtype_size(fmts[f].dtype);
        float *x = malloc((size_t)in->n * sizeof *x);
        uint16_t *y = malloc((size_t)in->n * sizeof *y);
        for (int64_t i = 0; i < in->n; i++) x[i] = float_of((uint32_t)in->v[i]);
        for (int k = 0; k < nimpl; k++) {
            set_impl(impls[k]);
            ms_cast(y, fmts[f].dtype, x, MS_F32, in->n);
            long long bad = 0, documented = 0, nan_bits = 0;
            for (int64_t i = 0; i < in->n; i++) {
                const uint32_t ms = code_at(y, size, i), t = (uint32_t)want->v[i];
                if (torch_agrees(f, (uint32_t)in->v[i], ms, t, &documented, &nan_bits)) continue;
                if (bad++ < 6)
                    printf("    f32->%s %s: %a (%08x): torch %0*x, moonshard %0*x\n", fmts[f].name, impl_name(impls[k]),
                           (double)x[i], (uint32_t)in->v[i], 2 * size, t, 2 * size, ms);
            }
            char what[160];
            snprintf(what, sizeof what, "f32->%s vs %s, %s: %lld samples%s", fmts[f].name, torch_name,
                     impl_name(impls[k]), (long long)in->n, torch_notes(documented, nan_bits));
            report(what, bad);
        }
        free(x);
        free(y);
    }
}

/* 7b. f64 -> each narrow float.  `_direct` is the code one correct rounding of the f64 would
 * give; where torch's differs (the double-rounding cases) torch went through f32, and
 * moonshard must give torch's code there too. */
static void check_torch_f64(const ms_cast_impl impls[], int nimpl) {
    const refrec *in = torch_rec("f64_in", -1);
    double *x = malloc((size_t)in->n * sizeof *x);
    uint16_t *y = malloc((size_t)in->n * sizeof *y);
    for (int64_t i = 0; i < in->n; i++) x[i] = refdata_f64(in, i);
    for (int f = 0; f < NFMT; f++) {
        const refrec *want = torch_recf(in->n, "f64_%s", fmts[f].name, "");
        const refrec *direct = torch_recf(in->n, "f64_%s_direct", fmts[f].name, "");
        const int size = ms_dtype_size(fmts[f].dtype);
        long long twice = 0; /* inputs where torch's code is not the once-rounded one */
        for (int64_t i = 0; i < in->n; i++) twice += !isnan(x[i]) && want->v[i] != direct->v[i];
        for (int k = 0; k < nimpl; k++) {
            set_impl(impls[k]);
            ms_cast(y, fmts[f].dtype, x, MS_F64, in->n);
            long long bad = 0, documented = 0, nan_bits = 0;
            for (int64_t i = 0; i < in->n; i++) {
                const uint32_t ms = code_at(y, size, i), t = (uint32_t)want->v[i];
                if (torch_agrees(f, bits_of((float)x[i]), ms, t, &documented, &nan_bits)) continue;
                if (bad++ < 6)
                    printf("    f64->%s %s: %a: torch %0*x, moonshard %0*x, once rounded %0*x\n", fmts[f].name,
                           impl_name(impls[k]), x[i], 2 * size, t, 2 * size, ms, 2 * size, (uint32_t)direct->v[i]);
            }
            char what[160];
            snprintf(what, sizeof what, "f64->%s vs %s, %s: %lld inputs, %lld rounded twice by torch%s", fmts[f].name,
                     torch_name, impl_name(impls[k]), (long long)in->n, twice, torch_notes(documented, nan_bits));
            report(what, bad);
        }
        /* Without such inputs the line above would not show that the f32 step is taken. */
        if (!twice) {
            printf("    f64->%s: casts.txt holds no input that torch rounds differently from once\n", fmts[f].name);
            report("f64 inputs where one rounding differs from two", 1);
        }
    }
    free(x);
    free(y);
}

/* 7c. every bf16 and f16 -> f32 by the digests of 256 codes at a time (NaN outputs of NaN
 * codes as all ones), every e4m3 and e5m2 -> f32 raw; NaN bits counted apart. */
static void check_torch_widening(const ms_cast_impl impls[], int nimpl) {
    uint16_t *codes = malloc(65536 * sizeof *codes);
    uint32_t *got = malloc(65536 * sizeof *got);
    for (uint32_t c = 0; c < 65536; c++) codes[c] = (uint16_t)c;
    uint8_t codes8[256];
    for (uint32_t c = 0; c < 256; c++) codes8[c] = (uint8_t)c;
    for (int f = 0; f < NFMT; f++) {
        const ref_fmt *F = &fmts[f];
        const uint32_t ncodes = 2 * F->sign_bit;
        const refrec *digests = NULL, *nan_out = NULL, *raw = NULL;
        uint32_t nnan = 0;
        for (uint32_t c = 0; c < ncodes; c++) nnan += is_nan_code(F, c);
        if (ncodes == 65536) {
            digests = torch_recf(256, "%s_f32_digest", F->name, "");
            nan_out = torch_recf(nnan, "%s_f32_nan_out", F->name, "");
        } else {
            raw = torch_recf(ncodes, "%s_f32", F->name, "");
        }
        for (int k = 0; k < nimpl; k++) {
            set_impl(impls[k]);
            ms_cast(got, MS_F32, ncodes == 65536 ? (const void *)codes : (const void *)codes8, F->dtype, ncodes);
            long long bad = 0, nan_bits = 0;
            /* NaN codes: torch's raw bits; both NaN is agreement (the bits counted apart),
             * and the digests take such an output as all ones */
            for (uint32_t c = 0, j = 0; c < ncodes; c++) {
                if (!is_nan_code(F, c)) continue;
                const uint32_t t = raw ? (uint32_t)raw->v[c] : (uint32_t)nan_out->v[j++];
                if (isnan(float_of(got[c])) && isnan(float_of(t))) {
                    nan_bits += got[c] != t;
                    got[c] = 0xFFFFFFFF;
                } else if (raw && bad++ < 6) {
                    printf("    %s->f32 %s: code %02x: torch %08x, moonshard %08x\n", F->name, impl_name(impls[k]), c,
                           t, got[c]);
                }
            }
            if (raw) {
                for (uint32_t c = 0; c < ncodes; c++)
                    if (!is_nan_code(F, c) && got[c] != (uint32_t)raw->v[c] && bad++ < 6)
                        printf("    %s->f32 %s: code %02x: torch %08x, moonshard %08x\n", F->name, impl_name(impls[k]),
                               c, (uint32_t)raw->v[c], got[c]);
            } else {
                for (uint32_t c = 0; c < ncodes; c += 256)
                    if (fold_codes(got + c, 256) != digests->v[c / 256] && bad++ < 6)
                        printf("    %s->f32 %s: codes %04x..%04x differ from torch's (by digest)\n", F->name,
                               impl_name(impls[k]), c, c + 255);
            }
            char what[160];
            snprintf(what, sizeof what, "%s->f32 vs %s, %s: %u codes%s%s", F->name, torch_name, impl_name(impls[k]),
                     ncodes, raw ? "" : " (256 digests)", torch_notes(0, nan_bits));
            report(what, bad);
        }
    }
    free(codes);
    free(got);
}

/* Casts a record's values (i64 values, or f64 ones made `src`) to `dst` and compares with
 * torch's record `want`: exactly, or for a narrow float by torch_agrees on the value's f32.
 * (Element bits are read little-endian, as x86 and the reference script have them.) */
static long long torch_cast_values(const ms_cast_impl impl, const refrec *in, ms_dtype src, ms_dtype dst,
                                   const refrec *want, const char *label, long long *documented, long long *nan_bits) {
    const int ss = ms_dtype_size(src), ds = ms_dtype_size(dst);
    unsigned char *x = malloc((size_t)(in->n * ss + 1)), *y = malloc((size_t)(in->n * ds + 1));
    for (int64_t i = 0; i < in->n; i++) { /* in: i64 values, or f64 values (kept as bits) */
        if (src == MS_F32) {
            const float v = (float)refdata_f64(in, i);
            memcpy(x + i * 4, &v, 4);
        } else if (src == MS_I32) {
            const int32_t v = (int32_t)(int64_t)in->v[i];
            memcpy(x + i * 4, &v, 4);
        } else {
            memcpy(x + i * 8, &in->v[i], 8); /* i64 or f64 */
        }
    }
    set_impl(impl);
    ms_cast(y, dst, x, src, in->n);
    long long bad = 0;
    const ref_fmt *F = fmt_of(dst);
    for (int64_t i = 0; i < in->n; i++) {
        uint64_t ms = 0;
        memcpy(&ms, y + i * ds, (size_t)ds);
        const uint64_t t = want->v[i];
        bool ok = ms == t;
        if (F) { /* a narrow float: by the value's f32 */
            float f32;
            if (src == MS_F32) memcpy(&f32, x + i * 4, 4);
            else if (src == MS_F64) f32 = (float)refdata_f64(in, i);
            else f32 = (float)(int64_t)in->v[i];
            ok = torch_agrees((int)(F - fmts), bits_of(f32), (uint32_t)ms, (uint32_t)t, documented, nan_bits);
        }
        if (!ok && bad++ < 6) {
            char v[40];
            if (src == MS_F32 || src == MS_F64) snprintf(v, sizeof v, "%a", refdata_f64(in, i));
            else snprintf(v, sizeof v, "%lld", (long long)(int64_t)in->v[i]);
            printf("    %s %s: %s: torch %0*llx, moonshard %0*llx\n", label, impl_name(impl), v, 2 * ds,
                   (unsigned long long)t, 2 * ds, (unsigned long long)ms);
        }
    }
    free(x);
    free(y);
    return bad;
}

/* 7d. integers -> floats and integers, floats -> bool and (values in range) -> integers. */
static void check_torch_integers(const ms_cast_impl impls[], int nimpl) {
    static const struct {
        const char *in, *src_name;
        ms_dtype src;
        const char *dst_name;
        ms_dtype dst;
    } pairs[] = {
        {"i64_in", "i64", MS_I64, "f32", MS_F32},       {"i64_in", "i64", MS_I64, "bf16", MS_BF16},
        {"i64_in", "i64", MS_I64, "f16", MS_F16},       {"i64_in", "i64", MS_I64, "e4m3", MS_F8E4M3},
        {"i64_in", "i64", MS_I64, "e5m2", MS_F8E5M2},   {"i32_in", "i32", MS_I32, "f32", MS_F32},
        {"i32_in", "i32", MS_I32, "bf16", MS_BF16},     {"i32_in", "i32", MS_I32, "f16", MS_F16},
        {"i32_in", "i32", MS_I32, "e4m3", MS_F8E4M3},   {"i32_in", "i32", MS_I32, "e5m2", MS_F8E5M2},
        {"i64_in", "i64", MS_I64, "i32", MS_I32},       {"i64_in", "i64", MS_I64, "i8", MS_I8},
        {"i64_in", "i64", MS_I64, "u8", MS_U8},         {"i64_in", "i64", MS_I64, "bool", MS_BOOL},
        {"bool_f64_in", "f32", MS_F32, "bool", MS_BOOL}, {"bool_f64_in", "f64", MS_F64, "bool", MS_BOOL},
        {"trunc_i64_in", "f32", MS_F32, "i64", MS_I64}, {"trunc_i64_in", "f64", MS_F64, "i64", MS_I64},
        {"trunc_i32_in", "f32", MS_F32, "i32", MS_I32}, {"trunc_i32_in", "f64", MS_F64, "i32", MS_I32},
        {"trunc_i8_in", "f32", MS_F32, "i8", MS_I8},    {"trunc_i8_in", "f64", MS_F64, "i8", MS_I8},
        {"trunc_u8_in", "f32", MS_F32, "u8", MS_U8},    {"trunc_u8_in", "f64", MS_F64, "u8", MS_U8},
    };
    for (int k = 0; k < nimpl; k++) {
        long long bad = 0, documented = 0, nan_bits = 0, values = 0;
        for (size_t p = 0; p < sizeof pairs / sizeof pairs[0]; p++) {
            const refrec *in = torch_rec(pairs[p].in, -1);
            const refrec *want = torch_recf(in->n, "%s_%s", pairs[p].src_name, pairs[p].dst_name);
            char label[48];
            snprintf(label, sizeof label, "%s->%s", pairs[p].src_name, pairs[p].dst_name);
            bad += torch_cast_values(impls[k], in, pairs[p].src, pairs[p].dst, want, label, &documented, &nan_bits);
            values += in->n;
        }
        char what[160];
        snprintf(what, sizeof what, "%d integer and bool pairs vs %s, %s: %lld values%s",
                 (int)(sizeof pairs / sizeof pairs[0]), torch_name, impl_name(impls[k]), values,
                 torch_notes(documented, nan_bits));
        report(what, bad);
    }
}

static void check_torch(const ms_cast_impl impls[], int nimpl) {
    printf("7. against %s's .to() (tests/reference/data/casts.txt; the sweep's lines are in 1.)\n", torch_name);
    check_torch_samples(impls, nimpl);
    check_torch_f64(impls, nimpl);
    check_torch_widening(impls, nimpl);
    check_torch_integers(impls, nimpl);
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
    torch_load();
    double t0 = now_s();
    check_every_f32();
    check_widening(impls, nimpl);
    check_edges(impls, nimpl);
    check_pairs(impls, nimpl);
    check_lengths(impls, nimpl);
    check_errors();
    check_torch(impls, nimpl);
    refdata_free(casts_ref);
    for (int f = 0; f < NFMT; f++) {
        free(fmts[f].value);
        free(fmts[f].up);
    }
    printf("test_cast: %s (%d failed checks, %.1f s)\n", failures ? "FAIL" : "ok", failures, now_s() - t0);
    return failures ? 1 : 0;
}
