/*
 * bench_mpi.c: moonshard's MPI backend against OpenMPI's own collectives, same buffers,
 * same ranks, same run (docs/performance.md).
 *
 *   all_gather      ms_all_gather           vs  MPI_Allgather
 *   reduce_scatter  ms_reduce_scatter (f32) vs  MPI_Reduce_scatter_block (MPI_FLOAT, MPI_SUM)
 *   all_reduce      ms_all_reduce (f32)     vs  MPI_Allreduce (MPI_FLOAT, MPI_SUM)
 *   small: a 64-byte all_gather, a 4 KiB all_reduce and a barrier (latency; the all_gather
 *   shows what the agreement on arguments costs each call)
 *   bf16 reduce_scatter: moonshard only (MPI has no bf16), busbw
 * S is the collective's whole buffer: the all_gather output, the reduce_scatter input, the
 * all_reduce buffer.  The two sides alternate: for the large buffers call by call within
 * each trial (A B B A A B ..., every call started by a barrier and timed alone, a side's
 * time the slowest rank's sum), for the latencies trial by trial (A B, B A, ...); the ratio
 * of each trial is t_OpenMPI / t_moonshard (above 1: moonshard is faster), printed as
 * min / median / max with the targets of the MPI backend.
 * Run on 2 ranks for ratios on this 2-core machine (4 oversubscribe it):
 *
 *   mpirun --allow-run-as-root -np 2 build/bench/bench_mpi [-s MiB,MiB,...] [-t trials]
 *   defaults: -s 1,64 -t 7; usage: see USAGE
 */
#include "bench.h"
#include "bench_args.h"
#include "moonshard.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_LIST 8
#define MAX_TRIALS 64
#define MAX_MIB 1024

static const char USAGE[] =
    "usage: mpirun --allow-run-as-root -np 2 bench_mpi [-s MiB,...] [-t TRIALS]\n"
    "  moonshard's MPI backend against OpenMPI's MPI_Allgather, MPI_Reduce_scatter_block and\n"
    "  MPI_Allreduce on the same buffers and ranks, a bf16 reduce_scatter (busbw only), and the\n"
    "  latency of a 64 B all_gather, a 4 KiB all_reduce and a barrier; the two sides interleaved,\n"
    "  ratios t(OpenMPI) / t(moonshard) min / median / max.  Needs 2 or more ranks; 2 on a\n"
    "  2-core machine (more oversubscribe it: scaling only).\n"
    "  -s MiB,...  sizes S of the collective's whole buffer, up to " BENCH_STR(MAX_LIST) " numbers above 0, at most\n"
    "              " BENCH_STR(MAX_MIB) " (default 1,64); rounded down to a multiple of 64 B x ranks\n"
    "  -t TRIALS   trials, an integer 1.." BENCH_STR(MAX_TRIALS) " (default 7)\n";

/* The command line into sizes[] (MiB; returns their count) and *trials. */
static int parse_args(int argc, char **argv, double *sizes, int *trials) {
    const char *r = getenv("OMPI_COMM_WORLD_RANK"); /* MPI is not started yet: under mpirun */
    if (!r) r = getenv("PMI_RANK");                 /* only the first rank speaks */
    bench_quiet = r && strcmp(r, "0");
    bench_args("bench_mpi", USAGE, argc, argv);
    int nsizes = 2;
    sizes[0] = 1, sizes[1] = 64, *trials = 7;
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i];
        if (!strcmp(opt, "-s"))
            nsizes = bench_list(opt, bench_value(argc, argv, &i), sizes, MAX_LIST, 0, MAX_MIB, false);
        else if (!strcmp(opt, "-t")) *trials = (int)bench_int(opt, bench_value(argc, argv, &i), 1, MAX_TRIALS);
        else bench_fail("unknown argument '%s'; expected -s or -t", opt);
    }
    return nsizes;
}

#ifndef MOONSHARD_HAVE_MPI

int main(int argc, char **argv) {
    double sizes[MAX_LIST];
    int trials;
    parse_args(argc, argv, sizes, &trials);
    printf("bench_mpi: moonshard was built without MPI; nothing to measure\n");
    return 0;
}

#else

#include <mpi.h>

static int rank, nranks;

static void must(ms_status st, const char *what) {
    if (st == MS_OK) return;
    fprintf(stderr, "bench_mpi (rank %d): %s: %s: %s\n", rank, what, ms_status_name(st), ms_last_error());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static void must_mpi(int rc, const char *what) {
    if (rc == MPI_SUCCESS) return;
    fprintf(stderr, "bench_mpi (rank %d): %s failed (%d)\n", rank, what, rc);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* A zero tensor of `bytes` of dtype, its pages faulted in. */
static ms_tensor *zeros(int64_t bytes, ms_dtype dtype) {
    int64_t shape[1] = {bytes / ms_dtype_size(dtype)};
    ms_tensor *t = NULL;
    must(ms_tensor_new(&t, 1, shape, dtype, MS_DEVICE_CPU, 0), "tensor_new");
    memset(ms_tensor_data(t), 0, (size_t)bytes);
    return t;
}

/* ---------------------------------------------------------------- the measured calls */

typedef enum side { OURS = 0, OPENMPI = 1 } side;

typedef enum op {
    ALL_GATHER,
    REDUCE_SCATTER,
    ALL_REDUCE,
    REDUCE_SCATTER_BF16,
    SMALL_ALL_GATHER,
    SMALL_ALL_REDUCE,
    BARRIER,
    NOPS
} op;

static const char *const op_name[NOPS] = {"all_gather", "reduce_scatter", "all_reduce", "reduce_scatter bf16",
                                          "all_gather 64 B", "all_reduce 4 KiB", "barrier"};
/* targets of t_OpenMPI / t_moonshard (0: none) and nccl-tests bus factors x n */
static const double target[NOPS] = {0.95, 2.5, 1.25, 0, 0, 0, 0};

typedef struct bufs {
    int64_t S;            /* bytes of the whole buffer */
    ms_tensor *ag_out;    /* (S) all_gather output */
    ms_tensor *ag_in;     /* (S/n) all_gather input */
    ms_tensor *rs_in;     /* (S) reduce_scatter input */
    ms_tensor *rs_out;    /* (S/n) reduce_scatter output */
    ms_tensor *ar;        /* (S) all_reduce buffer */
    ms_tensor *rs_in16;   /* (S) bf16 reduce_scatter input */
    ms_tensor *rs_out16;  /* (S/n) bf16 reduce_scatter output */
    ms_tensor *small_in;  /* (64 B) */
    ms_tensor *small_out; /* (n x 64 B) */
    ms_tensor *small_ar;  /* (4 KiB) */
} bufs;

static int64_t numel(const ms_tensor *t) { return ms_tensor_numel(t); }

static void run_once(ms_comm *c, bufs *b, op o, side s) {
    switch (o) {
    case ALL_GATHER:
        if (s == OURS) must(ms_all_gather(c, b->ag_out, b->ag_in), "all_gather");
        else must_mpi(MPI_Allgather(ms_tensor_data(b->ag_in), (int)numel(b->ag_in), MPI_FLOAT,
                                    ms_tensor_data(b->ag_out), (int)numel(b->ag_in), MPI_FLOAT, MPI_COMM_WORLD),
                      "MPI_Allgather");
        break;
    case REDUCE_SCATTER:
        if (s == OURS) must(ms_reduce_scatter(c, b->rs_out, b->rs_in, MS_OP_SUM), "reduce_scatter");
        else must_mpi(MPI_Reduce_scatter_block(ms_tensor_data(b->rs_in), ms_tensor_data(b->rs_out),
                                               (int)numel(b->rs_out), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD),
                      "MPI_Reduce_scatter_block");
        break;
    case ALL_REDUCE:
        if (s == OURS) must(ms_all_reduce(c, b->ar, MS_OP_SUM), "all_reduce");
        else must_mpi(MPI_Allreduce(MPI_IN_PLACE, ms_tensor_data(b->ar), (int)numel(b->ar), MPI_FLOAT, MPI_SUM,
                                    MPI_COMM_WORLD), "MPI_Allreduce");
        break;
    case REDUCE_SCATTER_BF16:
        must(ms_reduce_scatter(c, b->rs_out16, b->rs_in16, MS_OP_SUM), "reduce_scatter bf16");
        break;
    case SMALL_ALL_GATHER:
        if (s == OURS) must(ms_all_gather(c, b->small_out, b->small_in), "all_gather");
        else must_mpi(MPI_Allgather(ms_tensor_data(b->small_in), 16, MPI_FLOAT, ms_tensor_data(b->small_out), 16,
                                    MPI_FLOAT, MPI_COMM_WORLD), "MPI_Allgather");
        break;
    case SMALL_ALL_REDUCE:
        if (s == OURS) must(ms_all_reduce(c, b->small_ar, MS_OP_SUM), "all_reduce");
        else must_mpi(MPI_Allreduce(MPI_IN_PLACE, ms_tensor_data(b->small_ar), 1024, MPI_FLOAT, MPI_SUM,
                                    MPI_COMM_WORLD), "MPI_Allreduce");
        break;
    case BARRIER:
        if (s == OURS) must(ms_barrier(c), "barrier");
        else must_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
        break;
    case NOPS: break;
    }
}

/* Seconds per call of `iters` calls, the slowest rank's. */
static double timed(ms_comm *c, bufs *b, op o, side s, int iters) {
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < iters; i++) run_once(c, b, o, s);
    double t = (MPI_Wtime() - t0) / iters, slowest;
    MPI_Allreduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return slowest;
}

/* The bytes of the whole buffer and the busbw factor of o (docs/performance.md). */
static void sizes_of(const bufs *b, op o, double *S, double *factor) {
    const double n = nranks;
    switch (o) {
    case SMALL_ALL_GATHER: *S = 64.0 * n; *factor = (n - 1) / n; break;
    case SMALL_ALL_REDUCE: *S = 4096; *factor = 2 * (n - 1) / n; break;
    case BARRIER: *S = 0; *factor = 0; break;
    case ALL_REDUCE: *S = (double)b->S; *factor = 2 * (n - 1) / n; break;
    default: *S = (double)b->S; *factor = (n - 1) / n; break;
    }
}

/* Large buffers: `iters` pairs of calls, the two sides alternating call by call (A B, B A,
 * ...) so that the machine's slow drifts fall on both alike, each call started together
 * (a barrier) and timed alone; seconds per call of each side, the slowest rank's sum. */
static void timed_pairs(ms_comm *c, bufs *b, op o, int iters, double *ours, double *ref) {
    double sum[2] = {0, 0}, slowest[2];
    for (int i = 0; i < 2 * iters; i++) {
        const side s = (i / 2 + i) % 2 ? OPENMPI : OURS; /* A B B A A B B A ... */
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        run_once(c, b, o, s);
        sum[s] += MPI_Wtime() - t0;
    }
    MPI_Allreduce(sum, slowest, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    *ours = slowest[OURS] / iters, *ref = slowest[OPENMPI] / iters;
}

static void bench_op(ms_comm *c, bufs *b, op o, int trials, bool print_size) {
    const bool pair = o != REDUCE_SCATTER_BF16;
    const bool small = o >= SMALL_ALL_GATHER;
    /* iterations per trial and side: about 50 ms of work on this machine */
    int iters = small ? 2000 : (int)(256.0 * (1 << 20) / (double)b->S);
    if (iters < 2) iters = 2;
    run_once(c, b, o, OURS); /* warm: groups, staging, pages */
    if (pair) run_once(c, b, o, OPENMPI);
    double ours[MAX_TRIALS], ref[MAX_TRIALS], ratio[MAX_TRIALS];
    for (int t = 0; t < trials; t++) {
        if (pair && !small) {
            timed_pairs(c, b, o, iters, &ours[t], &ref[t]);
        } else { /* A B, B A, A B, ...: neither side always goes first */
            if (pair && t % 2) ref[t] = timed(c, b, o, OPENMPI, iters);
            ours[t] = timed(c, b, o, OURS, iters);
            if (pair && !(t % 2)) ref[t] = timed(c, b, o, OPENMPI, iters);
            if (!pair) ref[t] = 0;
        }
        ratio[t] = ref[t] / ours[t];
    }
    if (rank != 0) return;
    double S, factor;
    sizes_of(b, o, &S, &factor);
    double mo = median(ours, trials), mr = pair ? median(ref, trials) : 0;
    char size[32] = "";
    if (print_size) bench_bytes(size, sizeof size, (double)b->S);
    if (small) {
        printf("%-9s %-20s %10.1f us %22s", "", op_name[o], mo * 1e6, "");
        if (pair) printf(" %10.1f us %19s", mr * 1e6, "");
    } else {
        printf("%-9s %-20s %7.2f GB/s busbw %6.2f", size, op_name[o], S / mo / 1e9, S * factor / mo / 1e9);
        if (pair) printf("   %7.2f GB/s busbw %6.2f", S / mr / 1e9, S * factor / mr / 1e9);
        else printf("   %28s", "(no bf16 in MPI)");
    }
    if (pair) {
        qsort(ratio, (size_t)trials, sizeof *ratio, cmp_double);
        double med = median(ratio, trials);
        printf("   %5.2f / %5.2f / %5.2f", ratio[0], med, ratio[trials - 1]);
        if (target[o] > 0 && b->S >= (64 << 20))
            printf("   >= %.2fx %s", target[o], med >= target[o] ? "met" : "NOT MET");
    }
    printf("\n");
    fflush(stdout);
}

/* S of MiB at nranks ranks: whole 64-byte chunks per rank. */
static int64_t size_bytes(double mib) { return (int64_t)(mib * (1 << 20)) / (64 * nranks) * (64 * nranks); }

int main(int argc, char **argv) {
    double sizes[MAX_LIST];
    int trials;
    const int nsizes = parse_args(argc, argv, sizes, &trials);
    ms_world *w = NULL;
    ms_comm *c = NULL;
    must(ms_mpi_world_new(&w, 0), "mpi_world_new"); /* initialises MPI */
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);
    bench_quiet = rank != 0;
    /* every rank sees the same nranks and sizes, so all refuse alike */
    if (nranks < 2) {
        char cmd[512] = "";
        for (int i = 0; i < argc; i++) snprintf(cmd + strlen(cmd), sizeof cmd - strlen(cmd), " %s", argv[i]);
        ms_world_release(w);
        bench_fail("needs 2 or more ranks, this run has %d; launch it with mpirun, for 2 ranks:\n"
                   "  mpirun --allow-run-as-root -np 2%s", nranks, cmd);
    }
    for (int k = 0; k < nsizes; k++)
        if (size_bytes(sizes[k]) <= 0) {
            ms_world_release(w);
            bench_fail("-s %g MiB is below 64 B per rank at %d ranks: expected at least %d bytes", sizes[k], nranks,
                       64 * nranks);
        }
    must(ms_world_comm(w, rank, &c), "world_comm");
    int level;
    MPI_Query_thread(&level);
    if (rank == 0) {
        printf("bench_mpi: %d ranks, %d trials; ratio = t(OpenMPI) / t(moonshard): above 1 moonshard is faster%s\n",
               nranks, trials, nranks > 2 ? " (oversubscribed on 2 cores: scaling only)" : "");
        printf("MPI thread level %s\n", level == MPI_THREAD_MULTIPLE ? "MPI_THREAD_MULTIPLE" : "below MULTIPLE");
        printf("%-9s %-20s %-27s   %-27s   %-19s\n", "size", "collective", "moonshard", "OpenMPI",
               "ratio min/med/max");
    }
    for (int k = 0; k < nsizes; k++) {
        bufs b = {.S = size_bytes(sizes[k])};
        b.ag_out = zeros(b.S, MS_F32);
        b.ag_in = zeros(b.S / nranks, MS_F32);
        b.rs_in = zeros(b.S, MS_F32);
        b.rs_out = zeros(b.S / nranks, MS_F32);
        b.ar = zeros(b.S, MS_F32);
        b.rs_in16 = zeros(b.S, MS_BF16);
        b.rs_out16 = zeros(b.S / nranks, MS_BF16);
        b.small_in = zeros(64, MS_F32);
        b.small_out = zeros(64 * nranks, MS_F32);
        b.small_ar = zeros(4096, MS_F32);
        for (op o = ALL_GATHER; o <= REDUCE_SCATTER_BF16; o++) bench_op(c, &b, o, trials, o == ALL_GATHER);
        ms_tensor *all[] = {b.ag_out, b.ag_in, b.rs_in, b.rs_out, b.ar, b.rs_in16, b.rs_out16};
        for (size_t i = 0; i < sizeof all / sizeof *all; i++) ms_tensor_release(all[i]);
        if (k == nsizes - 1) {
            if (rank == 0) printf("latency\n");
            for (op o = SMALL_ALL_GATHER; o < NOPS; o++) bench_op(c, &b, o, trials, false);
        }
        ms_tensor_release(b.small_in);
        ms_tensor_release(b.small_out);
        ms_tensor_release(b.small_ar);
    }
    ms_comm_release(c);
    ms_world_release(w);
    return 0;
}

#endif /* MOONSHARD_HAVE_MPI */
