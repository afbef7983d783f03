/*
 * bench_collectives.c: the threads backend against references measured in the same run.
 *
 *   all_gather (out of place)   vs  each of n threads memcpy-ing S bytes at the same time
 *   reduce_scatter (f32 sum)    vs  each of n threads summing n local S/n-byte arrays
 *   all_reduce (f32 sum)           busbw only
 *   barrier, 4 KiB all_reduce      latency per call
 * S is the collective's whole buffer (docs/performance.md): the all_gather output, the reduce_scatter
 * input, the all_reduce buffer.  A and B alternate (A, B, A, B, ...) over the trials; the
 * ratio of each trial is t_reference / t_collective, printed as min / median / max.
 * Ratios are meaningful at n = 2 on this 2-core machine; n = 4 oversubscribes it and is
 * reported for scaling only.
 *
 * usage: see USAGE.
 */
#include "bench.h"
#include "bench_args.h"
#include "moonshard.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_RANKS 16
#define MAX_LIST 8
#define MAX_TRIALS 64
#define MAX_MIB 1024

static const char USAGE[] =
    "usage: bench_collectives [-s MiB,...] [-n RANKS,...] [-t TRIALS]\n"
    "  the threads backend's all_gather against n threads memcpy-ing the same bytes, its f32\n"
    "  reduce_scatter against n threads summing n local arrays, all_reduce (busbw only), and the\n"
    "  latency of a barrier and a 4 KiB all_reduce; collective and reference interleaved over the\n"
    "  trials, ratios min / median / max.\n"
    "  -s MiB,...    sizes S of the collective's whole buffer, up to " BENCH_STR(MAX_LIST) " numbers above 0, at most\n"
    "                " BENCH_STR(MAX_MIB) " (default 1,64); rounded down to whole f32 elements divisible by RANKS\n"
    "  -n RANKS,...  rank counts, up to " BENCH_STR(MAX_LIST) " integers 1.." BENCH_STR(MAX_RANKS) " (default 2,4)\n"
    "  -t TRIALS     trials, an integer 1.." BENCH_STR(MAX_TRIALS) " (default 7)\n";

/* ---------------------------------------------------------------- the local sum reference */

/* out = a_0 + a_1 + ... + a_{n-1}, each of count floats at a + j * count, in L1-sized
 * blocks so out is written once: the best a single thread does without moonshard. */
#define LOCAL_SUM_BODY                                                                    \
    for (int64_t off = 0; off < count; off += 2048) {                                    \
        int64_t m = count - off < 2048 ? count - off : 2048;                             \
        float *restrict o = out + off;                                                   \
        const float *restrict x = a + off, *restrict y = a + count + off;                \
        for (int64_t i = 0; i < m; i++) o[i] = x[i] + y[i];                              \
        for (int j = 2; j < n; j++) {                                                    \
            const float *restrict z = a + (int64_t)j * count + off;                      \
            for (int64_t i = 0; i < m; i++) o[i] += z[i];                                \
        }                                                                                \
    }

static void local_sum_portable(float *out, const float *a, int n, int64_t count) { LOCAL_SUM_BODY }
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2"))) static void local_sum_avx2(float *out, const float *a, int n, int64_t count) {
    LOCAL_SUM_BODY
}
#endif

static void local_sum(float *out, const float *a, int n, int64_t count) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2")) {
        local_sum_avx2(out, a, n, count);
        return;
    }
#endif
    local_sum_portable(out, a, n, count);
}

/* ---------------------------------------------------------------- rank threads */

typedef enum job {
    JOB_ALL_GATHER,
    JOB_MEMCPY,
    JOB_REDUCE_SCATTER,
    JOB_LOCAL_SUM,
    JOB_ALL_REDUCE,
    JOB_BARRIER,
    JOB_SMALL_ALL_REDUCE,
    JOB_QUIT
} job;

typedef struct rank_bufs {
    ms_tensor *ag_out; /* (S) all_gather output; memcpy destination; all_reduce buffer */
    ms_tensor *ag_in;  /* (S/n) all_gather input */
    ms_tensor *rs_in;  /* (S) reduce_scatter input; memcpy source; local sum input */
    ms_tensor *rs_out; /* (S/n) reduce_scatter output; local sum output */
    ms_tensor *small;  /* (1024) f32, 4 KiB all_reduce */
} rank_bufs;

typedef struct bench {
    int n;
    int64_t bytes; /* S, a multiple of 4 * n (whole f32 chunks) */
    ms_world *w;
    pthread_barrier_t start, end; /* n ranks + the main thread */
    job job;                      /* set by main before `start` */
    int iters;
} bench;

typedef struct rank_arg {
    bench *b;
    int rank;
} rank_arg;

static void must(ms_status st, const char *what) {
    if (st == MS_OK) return;
    fprintf(stderr, "bench_collectives: %s: %s: %s\n", what, ms_status_name(st), ms_last_error());
    exit(1);
}

/* A zero f32 tensor of `bytes` (a multiple of 4), its pages faulted in on this thread. */
static ms_tensor *touched(int64_t bytes) {
    int64_t shape[1] = {bytes / 4};
    ms_tensor *t = NULL;
    must(ms_tensor_new(&t, 1, shape, MS_F32, MS_DEVICE_CPU, 0), "tensor_new");
    memset(ms_tensor_data(t), 0, (size_t)bytes);
    return t;
}

static void run_job(const bench *b, ms_comm *c, rank_bufs *r, job j) {
    int64_t S = b->bytes;
    switch (j) {
    case JOB_ALL_GATHER: must(ms_all_gather(c, r->ag_out, r->ag_in), "all_gather"); break;
    case JOB_MEMCPY: memcpy(ms_tensor_data(r->ag_out), ms_tensor_data(r->rs_in), (size_t)S); break;
    case JOB_REDUCE_SCATTER: must(ms_reduce_scatter(c, r->rs_out, r->rs_in, MS_OP_SUM), "reduce_scatter"); break;
    case JOB_LOCAL_SUM: local_sum(ms_tensor_data(r->rs_out), ms_tensor_data(r->rs_in), b->n, S / 4 / b->n); break;
    case JOB_ALL_REDUCE: must(ms_all_reduce(c, r->ag_out, MS_OP_SUM), "all_reduce"); break;
    case JOB_BARRIER: must(ms_barrier(c), "barrier"); break;
    case JOB_SMALL_ALL_REDUCE: must(ms_all_reduce(c, r->small, MS_OP_SUM), "all_reduce"); break;
    case JOB_QUIT: break;
    }
}

static void *rank_main(void *p) {
    rank_arg *a = p;
    bench *b = a->b;
    ms_comm *c = NULL;
    must(ms_world_comm(b->w, a->rank, &c), "world_comm");
    rank_bufs r = {touched(b->bytes), touched(b->bytes / b->n), touched(b->bytes), touched(b->bytes / b->n),
                   touched(4096)};
    for (;;) {
        pthread_barrier_wait(&b->start);
        job j = b->job;
        if (j == JOB_QUIT) break;
        for (int i = 0; i < b->iters; i++) run_job(b, c, &r, j);
        pthread_barrier_wait(&b->end);
    }
    ms_tensor *all[] = {r.ag_out, r.ag_in, r.rs_in, r.rs_out, r.small};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) ms_tensor_release(all[i]);
    ms_comm_release(c);
    return NULL;
}

/* Seconds per call of job j, run iters times on every rank at once. */
static double timed(bench *b, job j, int iters) {
    b->job = j;
    b->iters = iters;
    double t0 = now_s();
    pthread_barrier_wait(&b->start);
    pthread_barrier_wait(&b->end);
    return (now_s() - t0) / iters;
}

/* ---------------------------------------------------------------- statistics and report */

typedef struct spread {
    double min, med, max;
} spread;

static spread spread_of(const double *v, int k) {
    double s[MAX_TRIALS];
    memcpy(s, v, (size_t)k * sizeof *s);
    qsort(s, (size_t)k, sizeof *s, cmp_double);
    return (spread){s[0], k % 2 ? s[k / 2] : 0.5 * (s[k / 2 - 1] + s[k / 2]), s[k - 1]};
}

/* A collective (t_a, seconds per call) against its reference (t_b) over the trials. */
static void report(const bench *b, const char *name, double factor, const double *t_a, const char *ref,
                   const double *t_b, int trials) {
    double S = (double)b->bytes, algbw[MAX_TRIALS] = {0}, ratio[MAX_TRIALS] = {0}, refbw[MAX_TRIALS] = {0};
    for (int k = 0; k < trials; k++) {
        algbw[k] = S / t_a[k] / 1e9;
        if (ref) ratio[k] = t_b[k] / t_a[k], refbw[k] = S / t_b[k] / 1e9;
    }
    spread bw = spread_of(algbw, trials);
    char size[32];
    printf("%-15s n=%-2d S=%-9s  algbw %6.2f GB/s  busbw %6.2f GB/s", name, b->n, bench_bytes(size, sizeof size, S),
           bw.med, bw.med * factor);
    if (ref) {
        spread r = spread_of(ratio, trials), rb = spread_of(refbw, trials);
        printf("  | %-9s %6.2f GB/s | ratio min %.3f med %.3f max %.3f", ref, rb.med, r.min, r.med, r.max);
    }
    printf("\n");
}

static void run_size(int n, int64_t bytes, int trials) {
    bench b = {.n = n, .bytes = bytes};
    must(ms_threads_world_new(&b.w, n, 0), "threads_world_new");
    pthread_barrier_init(&b.start, NULL, (unsigned)n + 1);
    pthread_barrier_init(&b.end, NULL, (unsigned)n + 1);
    pthread_t tid[MAX_RANKS];
    rank_arg args[MAX_RANKS];
    for (int r = 0; r < n; r++) {
        args[r] = (rank_arg){&b, r};
        pthread_create(&tid[r], NULL, rank_main, &args[r]);
    }
    int iters = bytes >= (256 << 20) ? 1 : (int)((256 << 20) / bytes); /* ~256 MiB per timing */
    double ag[MAX_TRIALS] = {0}, cp[MAX_TRIALS] = {0}, rs[MAX_TRIALS] = {0}, sum[MAX_TRIALS] = {0},
           ar[MAX_TRIALS] = {0};
    const job warm[] = {JOB_ALL_GATHER, JOB_MEMCPY, JOB_REDUCE_SCATTER, JOB_LOCAL_SUM, JOB_ALL_REDUCE};
    for (size_t i = 0; i < sizeof warm / sizeof warm[0]; i++) timed(&b, warm[i], 1);
    for (int k = 0; k < trials; k++) {
        ag[k] = timed(&b, JOB_ALL_GATHER, iters);
        cp[k] = timed(&b, JOB_MEMCPY, iters);
        rs[k] = timed(&b, JOB_REDUCE_SCATTER, iters);
        sum[k] = timed(&b, JOB_LOCAL_SUM, iters);
        ar[k] = timed(&b, JOB_ALL_REDUCE, iters);
    }
    double f = (double)(n - 1) / n;
    report(&b, "all_gather", f, ag, "memcpy", cp, trials);
    report(&b, "reduce_scatter", f, rs, "local sum", sum, trials);
    report(&b, "all_reduce", 2 * f, ar, NULL, NULL, trials);

    b.job = JOB_QUIT;
    pthread_barrier_wait(&b.start);
    for (int r = 0; r < n; r++) pthread_join(tid[r], NULL);
    pthread_barrier_destroy(&b.start);
    pthread_barrier_destroy(&b.end);
    ms_world_release(b.w);
}

/* Microseconds per barrier and per 4 KiB all_reduce, median over the trials. */
static void run_latency(int n, int trials) {
    bench b = {.n = n, .bytes = 4096 / (4 * n) * (4 * n)}; /* the big buffers stay unused */
    must(ms_threads_world_new(&b.w, n, 0), "threads_world_new");
    pthread_barrier_init(&b.start, NULL, (unsigned)n + 1);
    pthread_barrier_init(&b.end, NULL, (unsigned)n + 1);
    pthread_t tid[MAX_RANKS];
    rank_arg args[MAX_RANKS];
    for (int r = 0; r < n; r++) {
        args[r] = (rank_arg){&b, r};
        pthread_create(&tid[r], NULL, rank_main, &args[r]);
    }
    double bar[MAX_TRIALS] = {0}, small[MAX_TRIALS] = {0};
    timed(&b, JOB_BARRIER, 100);
    for (int k = 0; k < trials; k++) {
        bar[k] = timed(&b, JOB_BARRIER, 2000) * 1e6;
        small[k] = timed(&b, JOB_SMALL_ALL_REDUCE, 2000) * 1e6;
    }
    spread sb = spread_of(bar, trials), ss = spread_of(small, trials);
    printf("latency         n=%-2d barrier %6.2f us (min %.2f max %.2f)   all_reduce 4 KiB %6.2f us (min %.2f max %.2f)\n",
           n, sb.med, sb.min, sb.max, ss.med, ss.min, ss.max);
    b.job = JOB_QUIT;
    pthread_barrier_wait(&b.start);
    for (int r = 0; r < n; r++) pthread_join(tid[r], NULL);
    pthread_barrier_destroy(&b.start);
    pthread_barrier_destroy(&b.end);
    ms_world_release(b.w);
}

/* ---------------------------------------------------------------- main */

/* S of MiB at n ranks: whole f32 elements divisible by n. */
static int64_t size_bytes(double mib, int n) { return (int64_t)(mib * (1 << 20)) / (4 * n) * (4 * n); }

int main(int argc, char **argv) {
    double sizes[MAX_LIST] = {1, 64}, ranks[MAX_LIST] = {2, 4};
    int nsizes = 2, nranks = 2, trials = 7;
    bench_args("bench_collectives", USAGE, argc, argv);
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (!strcmp(opt, "-s"))
            nsizes = bench_list(opt, bench_value(argc, argv, &i), sizes, MAX_LIST, 0, MAX_MIB, false);
        else if (!strcmp(opt, "-n"))
            nranks = bench_list(opt, bench_value(argc, argv, &i), ranks, MAX_LIST, 1, MAX_RANKS, true);
        else if (!strcmp(opt, "-t")) trials = (int)bench_int(opt, bench_value(argc, argv, &i), 1, MAX_TRIALS);
        else bench_fail("unknown argument '%s'; expected -s, -n or -t", opt);
    }
    double most = 0; /* bytes of the largest run: per rank 2 S + 2 S/n */
    for (int i = 0; i < nranks; i++)
        for (int k = 0; k < nsizes; k++) {
            const int n = (int)ranks[i];
            const int64_t bytes = size_bytes(sizes[k], n);
            if (bytes <= 0)
                bench_fail("-s %g MiB holds no f32 element per rank at n = %d: expected at least %d bytes",
                           sizes[k], n, 4 * n);
            if (2.0 * (n + 1) * (double)bytes > most) most = 2.0 * (n + 1) * (double)bytes;
        }
    bench_memory(most, "smaller -s sizes or -n counts");

    printf("moonshard %s threads backend; %d trials, reference and collective interleaved\n", ms_version(), trials);
    for (int i = 0; i < nranks; i++) {
        int n = (int)ranks[i];
        for (int k = 0; k < nsizes; k++) run_size(n, size_bytes(sizes[k], n), trials);
        run_latency(n, trials);
    }
    return 0;
}
