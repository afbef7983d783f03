/*
 * bench_cast.c: ms_cast throughput against memcpy, measured in the same run (docs/performance.md).
 *
 * For each pair: a 64 MiB source, cast to a fresh destination; bytes moved = source bytes +
 * destination bytes.  The reference is a memcpy moving the same bytes (a copy of half of
 * them, from nonzero data: copies of zero pages run faster on these machines).  Trials
 * alternate the AVX2 cast and the memcpy, so drift on a shared machine hits both alike;
 * then, for the speedup, the AVX2 and the portable cast.  7 trials, min / median / max.
 *   ratio   = (cast bytes moved / s) / (memcpy bytes moved / s)       target >= 0.75
 *   speedup = portable time / AVX2 time
 * Usage: see USAGE.
 */
#include "bench.h"
#include "bench_args.h"
#include "ms_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TRIALS 7
#define MAX_MIB 4096 /* of source */

/* Bytes allocated per source byte: the source, two destinations of 4x (fp8 -> f32), and
 * memcpy's source and destination of half the 5x moved at most. */
#define BYTES_PER_SOURCE_BYTE 14

static const char USAGE[] =
    "usage: bench_cast [MiB] [PAIR...]\n"
    "  ms_cast's AVX2 path against a memcpy moving the same bytes (ratio), then against the\n"
    "  portable cast (speedup), " BENCH_STR(TRIALS) " trials interleaved; min / median / max and a summary table.\n"
    "  MiB   source bytes of each pair in MiB, an integer 1.." BENCH_STR(MAX_MIB) " (default 64); the run\n"
    "        allocates about " BENCH_STR(BYTES_PER_SOURCE_BYTE) "x that, which must fit in this machine's memory\n"
    "  PAIR  only the pairs named PAIR (spaces ignored: \"f32->bf16\" or \"f32 -> bf16\" as the\n"
    "        table prints it), else those whose name contains it (\"bf16\": every bf16 pair);\n"
    "        pairs: f32->bf16 bf16->f32 f32->f16 f16->f32 f32->f8e4m3 f8e4m3->f32 f32->f8e5m2\n"
    "        f8e5m2->f32 bf16->f16 f64->bf16 bf16->f8e4m3 i32->f32\n"
    "  exit status 0 when measured (a missed target included) or without AVX2, 1 on a failure,\n"
    "  2 on a bad argument\n";

static void *xmalloc(size_t n) {
    void *p = malloc(n);
    if (!p) {
        fprintf(stderr, "bench_cast: out of memory for %zu bytes\n", n);
        exit(1);
    }
    memset(p, 0, n); /* fault the pages in before any timing */
    return p;
}

static void check(ms_status st) {
    if (st != MS_OK) {
        fprintf(stderr, "bench_cast: %s: %s\n", ms_status_name(st), ms_last_error());
        exit(1);
    }
}

static double time_cast(ms_cast_impl impl, void *dst, ms_dtype dd, const void *src, ms_dtype sd, int64_t n) {
    check(ms_cast_set_impl(impl));
    double t0 = now_s();
    check(ms_cast(dst, dd, src, sd, n));
    return now_s() - t0;
}

static double time_memcpy(void *dst, const void *src, size_t bytes) {
    double t0 = now_s();
    memcpy(dst, src, bytes);
    return now_s() - t0;
}

/* Source values like trained weights: roughly normal, a spread of exponents, no NaN. */
static void fill_source(void *src, ms_dtype t, int64_t n) {
    enum { CHUNK = 1 << 16 };
    float *f = malloc(CHUNK * sizeof(float));
    uint64_t s = 0x2545F4914F6CDD1Dull;
    for (int64_t i = 0; i < n; i += CHUNK) {
        int64_t m = n - i < CHUNK ? n - i : CHUNK;
        for (int64_t k = 0; k < m; k++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17; /* xorshift64 */
            double u = (double)(s >> 11) * 0x1p-53;
            f[k] = (float)((u - 0.5) * 8.0 * (double)((s & 7) + 1)); /* |x| < 32 */
        }
        check(ms_cast((char *)src + i * ms_dtype_size(t), t, f, MS_F32, m));
    }
    free(f);
}

typedef struct pair {
    ms_dtype src, dst;
    bool target; /* docs/performance.md states the 0.75 target on it */
} pair;

static const pair pairs[] = { /* USAGE lists their names */
    {MS_F32, MS_BF16, true},     {MS_BF16, MS_F32, true},     {MS_F32, MS_F16, true},
    {MS_F16, MS_F32, true},      {MS_F32, MS_F8E4M3, false},  {MS_F8E4M3, MS_F32, false},
    {MS_F32, MS_F8E5M2, false},  {MS_F8E5M2, MS_F32, false},  {MS_BF16, MS_F16, false},
    {MS_F64, MS_BF16, false},    {MS_BF16, MS_F8E4M3, false}, {MS_I32, MS_F32, false},
};
enum { NPAIRS = sizeof pairs / sizeof pairs[0] };

/* "f32->bf16" of pair p into buf. */
static const char *pair_name(char *buf, size_t cap, int p) {
    snprintf(buf, cap, "%s->%s", ms_dtype_name(pairs[p].src), ms_dtype_name(pairs[p].dst));
    return buf;
}

/* Marks in run[] the pairs the filters f[0..nf) select (all without filters): a filter
 * naming a pair (spaces ignored) selects it alone, else every pair whose name contains it.
 * An unknown filter is refused with the valid names. */
static void select_pairs(bool *run, char **f, int nf) {
    for (int p = 0; p < NPAIRS; p++) run[p] = nf == 0;
    for (int i = 0; i < nf; i++) {
        char want[64], name[32];
        size_t k = 0;
        for (const char *c = f[i]; *c && k + 1 < sizeof want; c++)
            if (*c != ' ') want[k++] = *c;
        want[k] = '\0';
        int exact = -1, found = 0;
        for (int p = 0; p < NPAIRS; p++)
            if (!strcmp(pair_name(name, sizeof name, p), want)) exact = p;
        for (int p = 0; p < NPAIRS && k > 0; p++)
            if (exact == p || (exact < 0 && strstr(pair_name(name, sizeof name, p), want))) run[p] = true, found++;
        if (!found) {
            char names[512] = "";
            for (int p = 0; p < NPAIRS; p++) {
                strcat(names, p ? " " : "");
                strcat(names, pair_name(name, sizeof name, p));
            }
            bench_fail("no pair is named like '%s'; expected one of: %s (or part of a name)", f[i], names);
        }
    }
}

typedef struct result {
    bool skipped;
    double cast_gbs, memcpy_gbs, ratio[3], speedup;
} result;

int main(int argc, char **argv) {
    bench_args("bench_cast", USAGE, argc, argv);
    const int64_t src_bytes = (argc > 1 ? bench_int("MiB", argv[1], 1, MAX_MIB) : 64) << 20;
    bool run[NPAIRS];
    select_pairs(run, argv + 2, argc > 2 ? argc - 2 : 0);
    bench_memory((double)BYTES_PER_SOURCE_BYTE * (double)src_bytes, "a smaller MiB");
    if (ms_cast_set_impl(MS_CAST_AVX2) != MS_OK) {
        printf("bench_cast: %s; nothing to compare\n", ms_last_error());
        return 0;
    }
    /* The widest destination is 4x its source (fp8 -> f32); memcpy moves half the bytes. */
    const size_t max_moved = (size_t)src_bytes * 5;
    /* The portable cast writes its own destination: a destination left in cache by one
     * cast would slow the next one's streaming stores to it. */
    unsigned char *src = xmalloc((size_t)src_bytes), *dst = xmalloc((size_t)src_bytes * 4);
    unsigned char *port_dst = xmalloc((size_t)src_bytes * 4);
    unsigned char *msrc = xmalloc(max_moved / 2), *mdst = xmalloc(max_moved / 2);
    memset(msrc, 0x5A, max_moved / 2); /* nonzero: see the top */
    result res[NPAIRS];
    printf("bench_cast: %lld MiB sources, %d trials, interleaved AVX2 cast / memcpy, then AVX2 / portable\n",
           (long long)(src_bytes >> 20), TRIALS);
    double t_start = now_s();
    for (int p = 0; p < NPAIRS; p++) {
        const ms_dtype sd = pairs[p].src, dd = pairs[p].dst;
        if (!run[p]) {
            res[p].skipped = true;
            continue;
        }
        const int64_t n = src_bytes / ms_dtype_size(sd);
        const size_t moved = (size_t)(n * (ms_dtype_size(sd) + ms_dtype_size(dd)));
        fill_source(src, sd, n);
        double t_avx2[TRIALS], t_mem[TRIALS], t_port[TRIALS], ratio[TRIALS], speedup[TRIALS];
        time_cast(MS_CAST_AVX2, dst, dd, src, sd, n); /* warm-up: page tables, caches, clocks */
        time_memcpy(mdst, msrc, moved / 2);
        for (int t = 0; t < TRIALS; t++) {
            t_avx2[t] = time_cast(MS_CAST_AVX2, dst, dd, src, sd, n);
            t_mem[t] = time_memcpy(mdst, msrc, moved / 2);
            ratio[t] = t_mem[t] / t_avx2[t]; /* equal bytes moved: a ratio of bandwidths */
        }
        for (int t = 0; t < TRIALS; t++) {
            double t_a = time_cast(MS_CAST_AVX2, dst, dd, src, sd, n);
            t_port[t] = time_cast(MS_CAST_PORTABLE, port_dst, dd, src, sd, n);
            speedup[t] = t_port[t] / t_a;
        }
        result *r = &res[p];
        r->skipped = false;
        r->cast_gbs = (double)moved / median(t_avx2, TRIALS) * 1e-9;
        r->memcpy_gbs = (double)moved / median(t_mem, TRIALS) * 1e-9;
        r->ratio[1] = median(ratio, TRIALS);
        r->ratio[0] = ratio[0];
        r->ratio[2] = ratio[TRIALS - 1];
        r->speedup = median(speedup, TRIALS);
        printf("  %-6s -> %-6s  cast %6.2f GB/s  memcpy %6.2f GB/s  ratio %.2f / %.2f / %.2f  avx2 x%.1f\n",
               ms_dtype_name(sd), ms_dtype_name(dd), r->cast_gbs, r->memcpy_gbs, r->ratio[0], r->ratio[1],
               r->ratio[2], r->speedup);
        fflush(stdout);
    }

    printf("\nsummary (GB/s = bytes read + written per second, medians; ratio = cast / memcpy of the same bytes)\n");
    printf("| pair            | cast GB/s | memcpy GB/s | ratio min | ratio med | ratio max | AVX2 vs portable | target        |\n");
    printf("|-----------------|-----------|-------------|-----------|-----------|-----------|------------------|---------------|\n");
    int missed = 0;
    for (int p = 0; p < NPAIRS; p++) {
        const result *r = &res[p];
        if (r->skipped) continue;
        char name[32];
        snprintf(name, sizeof name, "%s -> %s", ms_dtype_name(pairs[p].src), ms_dtype_name(pairs[p].dst));
        const char *target = !pairs[p].target ? "-" : r->ratio[1] >= 0.75 ? ">=0.75 ok" : ">=0.75 MISSED";
        missed += pairs[p].target && r->ratio[1] < 0.75;
        printf("| %-15s | %9.2f | %11.2f | %9.2f | %9.2f | %9.2f | %15.1fx | %-13s |\n", name, r->cast_gbs,
               r->memcpy_gbs, r->ratio[0], r->ratio[1], r->ratio[2], r->speedup, target);
    }
    printf("\n%s (%.0f s)\n", missed ? "some targets missed" : "all targets met", now_s() - t_start);
    free(src);
    free(dst);
    free(port_dst);
    free(msrc);
    free(mdst);
    return 0;
}
