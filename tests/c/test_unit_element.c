/*
 * test_unit_element.c: the shard units' arithmetic as the CUDA kernels do it
 * (core/cuda/unit.cu: one element a thread through core/cuda/unit_element.h and
 * unit_math.h, compiled here for the host) against the host's (unit_math.c: ms__ew,
 * ms__sum_sq):
 *   - the element-wise step, every op, every ordered pair of float dtypes, rounding the
 *     addend or not, several scales, on probe values and random bits: bit for bit, except
 *     that a NaN result need only be a NaN (which operand's payload a sum of two NaNs keeps
 *     is the compiler's choice on the host, and a GPU gives the canonical NaN);
 *   - (AdamW is not here: the kernels call the update functions of unit_math.h that the
 *     host calls, element by element, so comparing the two would compare a function with
 *     itself.  test_adamw_torch checks those functions through a unit against
 *     torch.optim.AdamW's own bits, tests/gpu a unit on the GPU against one on the CPU.)
 *   - the sum of squares in the kernel's order (grid-stride per thread, a tree per block,
 *     the blocks in order) against ms__sum_sq: within n ulps of 2^-53 relative, the bound of
 *     two orders of an n-term f64 sum of non-negative terms (the largest seen is printed).
 */
#include "check.h"
#include "dtype_values.h"

#include "../../core/cuda/kernels.h"
#include "../../core/cuda/unit_element.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const ms_dtype floats[] = {MS_F32, MS_F64, MS_F16, MS_BF16, MS_F8E4M3, MS_F8E5M2};
enum { NFLOATS = sizeof floats / sizeof floats[0], CAP = (RANDOM + 64) * 8 };

/* Element i of p (dtype t) is a NaN. */
static int is_nan_at(const void *p, int64_t i, int t) { return isnan(ms_load_f64(p, i, t)); }

static void elementwise(void) {
    static unsigned char dst[CAP], src[CAP], want[CAP], got[CAP];
    static const double scales[] = {0.5, 3.0, 1.0 / 6, 1e-3, 4096.0};
    int cases = 0, bad_cases = 0;
    for (int a = 0; a < NFLOATS; a++)
        for (int b = 0; b < NFLOATS; b++)
            for (int op = MS_EW_MUL; op <= MS_EW_ADD; op++)
                for (int k = 0; k < (op == MS_EW_ADD ? 2 : 5); k++) {
                    const ms_dtype dd = floats[a], sd = floats[b];
                    if (op != MS_EW_ADD && b) continue; /* src unused: one pass per dst dtype */
                    const int64_t n = sources(dd, dst);
                    sources(sd, src);
                    const int es = ms_dtype_size(dd), round_src = op == MS_EW_ADD && k;
                    const double s = op == MS_EW_ADD ? 0 : scales[k];
                    memcpy(want, dst, (size_t)(n * es));
                    memcpy(got, dst, (size_t)(n * es));
                    ms__ew((ms_ew_op)op, want, dd, s, src, sd, round_src, n);
                    for (int64_t i = 0; i < n; i++) ms_ew_element(op, got, dd, s, src, sd, round_src, i);
                    int64_t bad = 0;
                    for (int64_t i = 0; i < n; i++) {
                        const int same = !memcmp(got + i * es, want + i * es, (size_t)es) ||
                                         (is_nan_at(got, i, dd) && is_nan_at(want, i, dd));
                        if (!same && !bad++)
                            fprintf(stderr, "ew op %d %s <- %s (round %d, s %g): element %lld differs\n", op,
                                    ms_dtype_name(dd), ms_dtype_name(sd), round_src, s, (long long)i);
                    }
                    cases++;
                    bad_cases += bad != 0;
                }
    printf("element-wise step: %d cases x %d values, %d differ from ms__ew\n", cases,
           (int)(sizeof probes / sizeof probes[0]) + 3 + RANDOM, bad_cases);
    CHECK(cases == NFLOATS * (2 * NFLOATS + 2 * 5) && bad_cases == 0);
}

/* The kernel's sum: MS_CUDA_SUM_BLOCKS blocks of 256 threads, each thread a grid-stride sum,
 * each block a tree over its threads, the blocks added in order on the host. */
static double kernel_order_sum_sq(const void *x, ms_dtype dt, int64_t n) {
    enum { T = 256, B = MS_CUDA_SUM_BLOCKS };
    static double acc[T];
    double total = 0;
    for (int blk = 0; blk < B; blk++) {
        for (int t = 0; t < T; t++) {
            double s = 0;
            for (int64_t i = (int64_t)blk * T + t; i < n; i += (int64_t)B * T) {
                const double v = ms_load_f64(x, i, dt);
                s += v * v;
            }
            acc[t] = s;
        }
        for (int half = T / 2; half > 0; half /= 2)
            for (int t = 0; t < half; t++) acc[t] += acc[t + half];
        total += acc[0];
    }
    return total;
}

static void sum_sq(void) {
    static const int64_t sizes[] = {0, 1, 5, 257, 65536, 100003, 1 << 20};
    float *x = malloc(sizeof(float) * (1 << 20));
    unsigned char *y = malloc(8u << 20);
    double worst = 0;
    int ok = x && y;
    for (int64_t i = 0; ok && i < 1 << 20; i++) x[i] = (float)((double)(next() % 200001) / 1e5 - 1);
    for (int d = 0; ok && d < NFLOATS; d++)
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            const int64_t n = sizes[k];
            CHECK_OK(ms_cast(y, floats[d], x, MS_F32, n));
            const double want = ms__sum_sq(y, floats[d], n), got = kernel_order_sum_sq(y, floats[d], n);
            const double rel = want ? fabs(got - want) / want : fabs(got);
            if (rel > worst) worst = rel;
            ok &= rel <= (double)(n + 1) * DBL_EPSILON / 2;
        }
    printf("sum of squares in the kernel's order: max relative difference from ms__sum_sq %.3g (6 dtypes, 0 to 2^20 "
           "elements)\n", worst);
    CHECK(ok);
    free(y);
    free(x);
}

int main(void) {
    elementwise();
    sum_sq();
    return check_summary("test_unit_element");
}
