/*
 * bench_unit.c: a training step through shard units against the same collectives and
 * compute called by hand, measured in the same run.
 *
 * One step over U units of one f32 parameter each (gathered and reduced in f32):
 *   forward   for each unit: unshard, wait, the kernel over the unsharded parameter, reshard
 *   backward  for each unit, last first: unshard, wait, the kernel writing the unsharded
 *             gradient, reduce_grads; every reduce is waited for at the end of the step
 * With prefetch on, the next unit's unshard is started before the current unit's kernel
 * (FSDP2's forward and backward prefetch of one unit); with it off, right before its wait.
 * The hand-written reference runs the same collectives synchronously on the rank's thread
 * over buffers allocated once: all_gather from the shard into the (W, S) buffer, the kernel
 * on it, reduce_scatter (avg) of the gradient and its accumulation into the gradient shard.
 * That is all a trainer written by hand for one flat parameter per unit does: it gathers
 * straight into the buffer the kernel reads and reduces straight from the buffer the kernel
 * writes, with no copy and no zeroing (the kernel overwrites the gradient).  The units run
 * the same collectives in the same dtype (f32 throughout: no casts on either side); a unit
 * of one dim-0 parameter works in place, so they copy no more either; on top they do what
 * their API promises (the unsharded gradient handed out zeroed, state checks, the
 * collectives handed to the communication thread, buffers from the rank's cache).  Their
 * reduce_grads is asynchronous and waited for at the end of the step, so even with prefetch
 * off it overlaps the next unit's backward kernel: the ratio may exceed 1.
 *   ratio   t_hand / t_units per trial (below 1: the units' overhead; above: overlap wins)
 *   hidden  1 - exposed_on / exposed_off, exposed = t_step - t_compute, t_compute the
 *           kernels of one step alone: the share of communication time prefetch hides
 * The four measurements alternate (hand, off, on, compute, hand, ...) over the trials and
 * print min / median / max.  docs/performance.md: on 2 cores, n = 2 with its 2 communication threads
 * already oversubscribes; figures at n = 4 are for scaling only.
 *
 * usage: see USAGE.
 */
#include "bench.h"
#include "bench_args.h"
#include "moonshard.h"

#include <limits.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { COLS = 1024, KBLOCK = 256 };
#define MAX_RANKS 16
#define MAX_UNITS 64
#define MAX_TRIALS 64
#define MAX_MIB 1024 /* per unit */

static const char USAGE[] =
    "usage: bench_unit [-n RANKS] [-u UNITS] [-m MiB] [-k FMA] [-t TRIALS]\n"
    "  a training step through shard units (prefetch off and on) against the same collectives\n"
    "  and kernel called by hand, and the kernels alone, on the threads backend, interleaved over\n"
    "  the trials; min / median / max of the step times, the ratios and the share prefetch hides.\n"
    "  -n RANKS   ranks, an integer 1.." BENCH_STR(MAX_RANKS) " (default 2)\n"
    "  -u UNITS   units of one f32 parameter each, an integer 1.." BENCH_STR(MAX_UNITS) " (default 4)\n"
    "  -m MiB     each parameter's size, a number above 0, at most " BENCH_STR(MAX_MIB) " (default 4); rounded\n"
    "             down to whole rows of 4 KiB, a multiple of RANKS rows and at least RANKS\n"
    "  -k FMA     dependent FMAs per element in the stand-in kernel, an integer >= 0 (default 48)\n"
    "  -t TRIALS  trials, an integer 1.." BENCH_STR(MAX_TRIALS) " (default 7)\n";

static void must(ms_status st, const char *what) {
    if (st == MS_OK) return;
    fprintf(stderr, "bench_unit: %s: %s: %s\n", what, ms_status_name(st), ms_last_error());
    exit(1);
}

/* The stand-in compute: y[i] = k steps of a = a * c + x[i] from a = x[i] (k dependent FMAs
 * per element, vectorised across a block of elements). */
static void kernel(float *restrict y, const float *restrict x, int64_t n, int k) {
    float a[KBLOCK]; /* (m) the running values of one block */
    for (int64_t off = 0; off < n; off += KBLOCK) {
        const int64_t m = n - off < KBLOCK ? n - off : KBLOCK;
        const float *xb = x + off;
        for (int64_t i = 0; i < m; i++) a[i] = xb[i];
        for (int j = 0; j < k; j++)
            for (int64_t i = 0; i < m; i++) a[i] = a[i] * 0.999f + xb[i];
        memcpy(y + off, a, (size_t)m * sizeof *a);
    }
}

/* ---------------------------------------------------------------- one rank */

typedef struct config {
    int n, units, k, trials;
    int64_t rows; /* of each unit's [rows, COLS] parameter; a multiple of n */
} config;

typedef enum run_kind { RUN_HAND, RUN_OFF, RUN_ON, RUN_COMPUTE, RUN_KINDS } run_kind;

typedef struct results {
    double t[RUN_KINDS][MAX_TRIALS]; /* seconds per step, written by rank 0 */
} results;

typedef struct rank_arg {
    ms_world *w;
    int rank;
    const config *cfg;
    results *res;
} rank_arg;

typedef struct hand_unit {
    ms_tensor *shard;    /* (rows/n, COLS) f32: this rank's shard */
    ms_tensor *gathered; /* (rows, COLS) f32: the (W, S) all_gather output, the parameter */
    ms_tensor *grad;     /* (rows, COLS) f32: the unsharded gradient */
    ms_tensor *reduced;  /* (rows/n, COLS) f32: the reduce_scatter output */
    ms_tensor *grad_shard; /* (rows/n, COLS) f32: the accumulated gradient shard */
} hand_unit;

static ms_tensor *tensor(int64_t rows) {
    ms_tensor *t = NULL;
    must(ms_tensor_new(&t, 2, (int64_t[]){rows, COLS}, MS_F32, MS_DEVICE_CPU, 0), "tensor_new");
    must(ms_tensor_fill(t, 0.5), "tensor_fill");
    return t;
}

static void step_hand(ms_comm *c, hand_unit *h, int U, float *act, int k) {
    const int64_t elems = ms_tensor_numel(h[0].gathered), shard = ms_tensor_numel(h[0].shard);
    for (int i = 0; i < U; i++) {
        must(ms_all_gather(c, h[i].gathered, h[i].shard), "all_gather");
        kernel(act, ms_tensor_data(h[i].gathered), elems, k);
    }
    for (int i = U - 1; i >= 0; i--) {
        must(ms_all_gather(c, h[i].gathered, h[i].shard), "all_gather");
        kernel(ms_tensor_data(h[i].grad), ms_tensor_data(h[i].gathered), elems, k);
        must(ms_reduce_scatter(c, h[i].reduced, h[i].grad, MS_OP_AVG), "reduce_scatter");
        float *g = ms_tensor_data(h[i].grad_shard);
        const float *r = ms_tensor_data(h[i].reduced);
        for (int64_t j = 0; j < shard; j++) g[j] += r[j];
    }
}

static void step_units(ms_unit **u, int U, float *act, int64_t elems, int k, bool prefetch) {
    if (prefetch) must(ms_unit_unshard(u[0]), "unshard");
    for (int i = 0; i < U; i++) {
        if (!prefetch) must(ms_unit_unshard(u[i]), "unshard");
        else if (i + 1 < U) must(ms_unit_unshard(u[i + 1]), "unshard");
        must(ms_unit_wait(u[i]), "wait");
        kernel(act, ms_tensor_data(ms_unit_param_full(u[i], 0)), elems, k);
        must(ms_unit_reshard(u[i]), "reshard");
    }
    if (prefetch) must(ms_unit_unshard(u[U - 1]), "unshard");
    for (int i = U - 1; i >= 0; i--) {
        if (!prefetch) must(ms_unit_unshard(u[i]), "unshard");
        else if (i > 0) must(ms_unit_unshard(u[i - 1]), "unshard");
        must(ms_unit_wait(u[i]), "wait");
        kernel(ms_tensor_data(ms_unit_grad_full(u[i], 0)), ms_tensor_data(ms_unit_param_full(u[i], 0)), elems, k);
        must(ms_unit_reduce_grads(u[i]), "reduce_grads");
    }
    for (int i = 0; i < U; i++) {
        must(ms_unit_wait(u[i]), "wait");
        ms_unit_clear_records(u[i]);
    }
}

static void step_compute(hand_unit *h, int U, float *act, int k) {
    const int64_t elems = ms_tensor_numel(h[0].gathered);
    for (int i = 0; i < U; i++) kernel(act, ms_tensor_data(h[i].gathered), elems, k);
    for (int i = U - 1; i >= 0; i--) kernel(ms_tensor_data(h[i].grad), ms_tensor_data(h[i].gathered), elems, k);
}

static void *rank_main(void *p) {
    rank_arg *a = p;
    const config *cfg = a->cfg;
    const int U = cfg->units;
    ms_comm *c = NULL;
    must(ms_world_comm(a->w, a->rank, &c), "world_comm");
    const int64_t elems = cfg->rows * COLS;
    float *act = calloc((size_t)elems, sizeof *act); /* (elems) forward output of the kernel */
    hand_unit h[MAX_UNITS];
    ms_unit *u[MAX_UNITS];
    for (int i = 0; i < U; i++) {
        h[i] = (hand_unit){tensor(cfg->rows / cfg->n), tensor(cfg->rows), tensor(cfg->rows),
                           tensor(cfg->rows / cfg->n), tensor(cfg->rows / cfg->n)};
        char name[32];
        snprintf(name, sizeof name, "layers.%d", i);
        must(ms_unit_new(&u[i], name, c, NULL, -1, -1, MS_RESHARD_FULL), "unit_new");
        must(ms_unit_add_param(u[i], "weight", 2, (int64_t[]){cfg->rows, COLS}, MS_F32, 0, 1), "add_param");
        must(ms_unit_finalize(u[i]), "finalize");
        must(ms_tensor_fill(ms_unit_param_shard(u[i], 0), 0.5), "fill");
    }
    for (int trial = -1; trial < cfg->trials; trial++) { /* trial -1 warms up */
        for (int kind = 0; kind < RUN_KINDS; kind++) {
            must(ms_barrier(c), "barrier");
            double t0 = now_s();
            switch ((run_kind)kind) {
            case RUN_HAND: step_hand(c, h, U, act, cfg->k); break;
            case RUN_OFF: step_units(u, U, act, elems, cfg->k, false); break;
            case RUN_ON: step_units(u, U, act, elems, cfg->k, true); break;
            case RUN_COMPUTE: step_compute(h, U, act, cfg->k); break;
            case RUN_KINDS: break;
            }
            must(ms_barrier(c), "barrier");
            if (a->rank == 0 && trial >= 0) a->res->t[kind][trial] = now_s() - t0;
        }
    }
    for (int i = 0; i < U; i++) {
        ms_unit_release(u[i]);
        ms_tensor_release(h[i].shard);
        ms_tensor_release(h[i].gathered);
        ms_tensor_release(h[i].grad);
        ms_tensor_release(h[i].reduced);
        ms_tensor_release(h[i].grad_shard);
    }
    free(act);
    ms_comm_release(c);
    return NULL;
}

/* ---------------------------------------------------------------- statistics and report */

/* "min a med b max c" of v[0..k) into buf. */
static const char *spread(char *buf, size_t cap, const double *v, int k, const char *fmt) {
    double s[MAX_TRIALS];
    memcpy(s, v, (size_t)k * sizeof *s);
    qsort(s, (size_t)k, sizeof *s, cmp_double);
    double med = k % 2 ? s[k / 2] : 0.5 * (s[k / 2 - 1] + s[k / 2]);
    char a[32], b[32], c[32];
    snprintf(a, sizeof a, fmt, s[0]);
    snprintf(b, sizeof b, fmt, med);
    snprintf(c, sizeof c, fmt, s[k - 1]);
    snprintf(buf, cap, "min %s med %s max %s", a, b, c);
    return buf;
}

static void run(const config *cfg) {
    ms_world *w = NULL;
    must(ms_threads_world_new(&w, cfg->n, 0), "threads_world_new");
    results *res = calloc(1, sizeof *res);
    rank_arg args[MAX_RANKS];
    pthread_t tid[MAX_RANKS];
    for (int r = 0; r < cfg->n; r++) {
        args[r] = (rank_arg){w, r, cfg, res};
        pthread_create(&tid[r], NULL, rank_main, &args[r]);
    }
    for (int r = 0; r < cfg->n; r++) pthread_join(tid[r], NULL);
    ms_world_release(w);

    const int T = cfg->trials;
    double off[MAX_TRIALS], on[MAX_TRIALS], hidden[MAX_TRIALS], ms[RUN_KINDS][MAX_TRIALS];
    for (int k = 0; k < T; k++) {
        off[k] = res->t[RUN_HAND][k] / res->t[RUN_OFF][k];
        on[k] = res->t[RUN_HAND][k] / res->t[RUN_ON][k];
        double comp = res->t[RUN_COMPUTE][k];
        hidden[k] = 1 - (res->t[RUN_ON][k] - comp) / (res->t[RUN_OFF][k] - comp);
        for (int j = 0; j < RUN_KINDS; j++) ms[j][k] = 1e3 * res->t[j][k];
    }
    char b[4][128];
    printf("n=%d units=%d param=%.6g MiB k=%d\n", cfg->n, cfg->units, (double)cfg->rows * COLS * 4 / (1 << 20),
           cfg->k);
    printf("  step ms   hand %s | prefetch off %s | on %s | compute only %s\n",
           spread(b[0], sizeof b[0], ms[RUN_HAND], T, "%.2f"), spread(b[1], sizeof b[1], ms[RUN_OFF], T, "%.2f"),
           spread(b[2], sizeof b[2], ms[RUN_ON], T, "%.2f"), spread(b[3], sizeof b[3], ms[RUN_COMPUTE], T, "%.2f"));
    printf("  ratio t_hand/t_units  prefetch off %s | on %s\n", spread(b[0], sizeof b[0], off, T, "%.3f"),
           spread(b[1], sizeof b[1], on, T, "%.3f"));
    printf("  communication hidden by prefetch  %s\n", spread(b[2], sizeof b[2], hidden, T, "%.2f"));
    free(res);
}

int main(int argc, char **argv) {
    config cfg = {.n = 2, .units = 4, .k = 48, .trials = 7};
    double mib = 4;
    bench_args("bench_unit", USAGE, argc, argv);
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (!strcmp(opt, "-n")) cfg.n = (int)bench_int(opt, bench_value(argc, argv, &i), 1, MAX_RANKS);
        else if (!strcmp(opt, "-u")) cfg.units = (int)bench_int(opt, bench_value(argc, argv, &i), 1, MAX_UNITS);
        else if (!strcmp(opt, "-m")) mib = bench_real(opt, bench_value(argc, argv, &i), 0, MAX_MIB);
        else if (!strcmp(opt, "-k")) cfg.k = (int)bench_int(opt, bench_value(argc, argv, &i), 0, INT_MAX);
        else if (!strcmp(opt, "-t")) cfg.trials = (int)bench_int(opt, bench_value(argc, argv, &i), 1, MAX_TRIALS);
        else bench_fail("unknown argument '%s'; expected -n, -u, -m, -k or -t", opt);
    }
    int64_t rows = (int64_t)(mib * (1 << 20) / 4 / COLS);
    cfg.rows = rows / cfg.n * cfg.n > 0 ? rows / cfg.n * cfg.n : cfg.n;
    /* per rank and unit about 6 parameters' bytes (measured: both sides' buffers, the units'
     * cache), and the activations */
    const double param = (double)cfg.rows * COLS * 4;
    bench_memory(cfg.n * (6.0 * cfg.units + 1) * param, "a smaller -m, -u or -n");
    run(&cfg);
    return 0;
}
