/*
 * bench_cuda.c: casts on a CUDA device against the device's own memory bandwidth, measured
 * in the same run by a device-to-device copy (docs/performance.md: ratios, interleaved, 7 trials).
 *
 * For each f32 <-> bf16 / f16 / e4m3 / e5m2 pair: a source of N elements (default 2^28,
 * 1 GiB of f32) cast into a device tensor; bytes moved = source + destination bytes.  The
 * reference copies a device tensor of the same bytes as the cast moves, over half of them
 * each way (a copy of B bytes reads B and writes B).  Every call is synchronous, so the host
 * clock times the device work (kernel launch overhead is microseconds against
 * milliseconds).
 *   fraction = (cast bytes moved / s) / (copy bytes moved / s)
 * Usage: see USAGE.  Exits 77 without a CUDA device.
 */
#include "bench.h"
#include "bench_args.h"
#include "moonshard.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define TRIALS 7

static const char USAGE[] =
    "usage: bench_cuda [LOG2]\n"
    "  casts f32 <-> bf16 / f16 / f8e4m3 / f8e5m2 on cuda:0 against a device-to-device copy of\n"
    "  the same bytes, " BENCH_STR(TRIALS) " trials interleaved: GB/s and the fraction of the copy's bandwidth\n"
    "  min / median / max.\n"
    "  LOG2  log2 of the elements of each cast, an integer 10..32 (default 28: 1 GiB of f32)\n"
    "  exit status 0 when measured, 77 without a CUDA device (skipped), 1 on a failure, 2 on a\n"
    "  bad argument\n";

static void check(ms_status st) {
    if (st != MS_OK) {
        fprintf(stderr, "bench_cuda: %s: %s\n", ms_status_name(st), ms_last_error());
        exit(1);
    }
}

static ms_tensor *device_tensor(int64_t n, ms_dtype dt) {
    ms_tensor *t = NULL;
    check(ms_tensor_new(&t, 1, &n, dt, MS_DEVICE_CUDA, 0));
    return t;
}

/* Seconds of one dst <- src (a cast, or a copy when the dtypes agree). */
static double time_copy(ms_tensor *dst, const ms_tensor *src) {
    double t0 = now_s();
    check(ms_tensor_copy(dst, src));
    return now_s() - t0;
}

int main(int argc, char **argv) {
    bench_args("bench_cuda", USAGE, argc, argv);
    if (argc > 2) bench_fail("unexpected argument '%s'; expected at most LOG2", argv[2]);
    const int lg = argc > 1 ? (int)bench_int("LOG2", argv[1], 10, 32) : 28;
    int ndev = 0;
    if (ms_cuda_device_count(&ndev) != MS_OK) {
        printf("bench_cuda: skipped: %s\n", ms_last_error());
        return 77;
    }
    const int64_t n = (int64_t)1 << lg;
    const ms_dtype narrow[] = {MS_BF16, MS_F16, MS_F8E4M3, MS_F8E5M2};
    printf("bench_cuda: %lld elements, %d trials, on cuda:0 of %d device%s\n", (long long)n, TRIALS, ndev,
           ndev == 1 ? "" : "s");
    printf("%-16s %10s %10s   fraction of the copy's bandwidth min / median / max\n", "cast", "GB/s", "copy GB/s");
    ms_tensor *f32 = device_tensor(n, MS_F32);
    check(ms_tensor_fill(f32, 1.0 / 3.0));
    for (int dir = 0; dir < 2; dir++)
        for (int k = 0; k < 4; k++) {
            const int64_t moved = n * (4 + ms_dtype_size(narrow[k]));
            ms_tensor *other = device_tensor(n, narrow[k]);
            ms_tensor *a = device_tensor(moved / 2, MS_U8), *b = device_tensor(moved / 2, MS_U8);
            check(ms_tensor_fill(a, 7)); /* nonzero data to copy */
            check(ms_tensor_copy(other, f32));
            double ratio[TRIALS], cast_bw[TRIALS], copy_bw[TRIALS];
            for (int t = 0; t < TRIALS; t++) {
                double tc = dir ? time_copy(f32, other) : time_copy(other, f32);
                double tm = time_copy(b, a);
                cast_bw[t] = (double)moved / tc / 1e9;
                copy_bw[t] = (double)moved / tm / 1e9;
                ratio[t] = cast_bw[t] / copy_bw[t];
            }
            qsort(ratio, TRIALS, sizeof *ratio, cmp_double);
            qsort(cast_bw, TRIALS, sizeof *cast_bw, cmp_double);
            qsort(copy_bw, TRIALS, sizeof *copy_bw, cmp_double);
            char name[32];
            snprintf(name, sizeof name, "%s -> %s", dir ? ms_dtype_name(narrow[k]) : "f32",
                     dir ? "f32" : ms_dtype_name(narrow[k]));
            printf("%-16s %10.0f %10.0f   %.2f / %.2f / %.2f\n", name, cast_bw[TRIALS / 2], copy_bw[TRIALS / 2],
                   ratio[0], ratio[TRIALS / 2], ratio[TRIALS - 1]);
            ms_tensor_release(other);
            ms_tensor_release(a);
            ms_tensor_release(b);
        }
    ms_tensor_release(f32);
    return 0;
}
