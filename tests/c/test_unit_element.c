/*
 * test_unit_element.c: the shard units' arithmetic as the CUDA kernels do it
 * (core/cuda/unit.cu: one element a thread through core/cuda/unit_element.h and
 * unit_math.h, compiled here for the host) against the host's (unit_math.c: ms__ew,
 * ms__adamw, ms__sum_sq):
 *   - the element-wise step, every op, every ordered pair of float dtypes, rounding the
 *     addend or not, several scales, on probe values and random bits: bit for bit, except
 *     that a NaN result need only be a NaN (which operand's payload a sum of two NaNs keeps
 *     is the compiler's choice on the host, and a GPU gives the canonical NaN);
 *   - AdamW element by element (f32 weights, each float gradient dtype, with and without a
 *     stored copy of each float dtype, both branches of the first moment's lerp) against
 *     ms__adamw: bit for bit; and the update against PyTorch's own AdamW, as bits written
 *     down from torch 2.15 on the CPU;
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

static void adamw(void) {
    enum { n = 3000 };
    static float w1[n], m1[n], v1[n], w2[n], m2[n], v2[n];
    static unsigned char grad[n * 8], st1[n * 8], st2[n * 8];
    /* beta1 0.9 and 0.3: both branches of the first moment's lerp */
    const ms_adamw_hyper hs[2] = {{.decay = (float)(1 - 1e-3 * 0.1), .w1 = (float)(1 - 0.9), .b2 = 0.95f,
                                   .c2 = (float)(1 - 0.95), .step_size = (float)(1e-3 / (1 - 0.9 * 0.9)),
                                   .bc2_sqrt = (float)sqrt(1 - 0.95 * 0.95), .eps = 1e-8f},
                                  {.decay = (float)(1 - 1e-1 * 0.5), .w1 = (float)(1 - 0.3), .b2 = 0.99f,
                                   .c2 = (float)(1 - 0.99), .step_size = (float)(1e-1 / (1 - 0.3 * 0.3)),
                                   .bc2_sqrt = (float)sqrt(1 - 0.99 * 0.99), .eps = 1e-8f}};
    int cases = 0, bad_cases = 0;
    for (int ka = 0; ka < 2 * NFLOATS; ka++) /* k: the hyper-parameters, a: the gradient dtype */
        for (int b = -1; b < NFLOATS; b++) { /* b: the stored copy's dtype, -1 none */
            const int k = ka / NFLOATS, a = ka % NFLOATS;
            const ms_dtype gdt = floats[a], sdt = b < 0 ? MS_F32 : floats[b];
            double vals[n];
            for (int i = 0; i < n; i++) {
                w1[i] = w2[i] = (float)((double)(next() % 20001) / 10000 - 1);
                m1[i] = m2[i] = (float)((double)(next() % 2001) / 1e5 - 0.01);
                v1[i] = v2[i] = (float)((double)(next() % 1001) / 1e6);
                vals[i] = (double)(next() % 4001) / 2000 - 1;
            }
            CHECK_OK(ms_cast(grad, gdt, vals, MS_F64, n));
            for (int step = 0; step < 3; step++) {
                ms__adamw(w1, m1, v1, grad, gdt, b < 0 ? NULL : st1, sdt, n, &hs[k]);
                for (int64_t i = 0; i < n; i++) {
                    ms_adamw_update(&w2[i], &m2[i], &v2[i], ms_load_f32(grad, i, gdt), &hs[k]);
                    if (b >= 0) ms_store_f32(st2, i, sdt, w2[i]);
                }
            }
            const int same = !memcmp(w1, w2, sizeof w1) && !memcmp(m1, m2, sizeof m1) && !memcmp(v1, v2, sizeof v1) &&
                             (b < 0 || !memcmp(st1, st2, (size_t)(n * ms_dtype_size(sdt))));
            cases++;
            bad_cases += !same;
        }
    printf("AdamW: %d cases (beta1 x gradient dtype x stored copy), 3 steps of %d elements, %d differ from ms__adamw\n",
           cases, n, bad_cases);
    CHECK(cases == 2 * NFLOATS * (NFLOATS + 1) && bad_cases == 0);
}

/* AdamW against PyTorch 2.15 itself: torch.optim.AdamW(foreach=False) on the CPU (AVX-512
 * dispatch), three steps of 12 f32 elements per setting, written down as bits.  The
 * elements were picked where torch's sqrt is correctly rounded at every step (it is not
 * always; unit_math.h) and 8 of each 12 are where an unfused lerp or addcmul (one rounding
 * per operation) gives other bits.  The hyper-parameters are rounded to f32 here as
 * torch's kernels take its Python floats. */
typedef struct torch_case {
    double lr, beta1, beta2, eps, wd;
    uint32_t w0[12], g[3][12], w[12], m[12], v[12];
} torch_case;

static const torch_case torch_cases[] = {
    {0.001, 0.9, 0.95, 1e-08, 0.1,
     {0x3d8f0af0, 0xbf1a3678, 0x3ea0a7d8, 0xbf08d37a, 0x3e84d99c, 0x3f35bb1c, 0x3dd0a170, 0xbeda46e0, 0x3ea30864, 0xbe197968, 0xbf15f8d2, 0xbe89ea90},
     {{0x3db89a34, 0x3c8cef4f, 0xbcaf712f, 0xbd4c3a83, 0xbc887b4b, 0x3c27da46, 0x3cf7100b, 0xbb8af85c, 0x3c4d2fd0, 0xbc23bf5f, 0xbd3089d4, 0xbd40edd2},
      {0xbda44c88, 0xbd2cfc47, 0x3d66b70f, 0xbc748788, 0x3d6ece00, 0xbc2cba05, 0xbcb9b1d9, 0xbce4b10f, 0x3bab03e0, 0x3df796a2, 0xbd6485ad, 0x3db2e634},
      {0x3dcc62a3, 0xbc961625, 0xbd0f4ac2, 0x3d17c916, 0x3d87251e, 0x3cd6f8e2, 0xbb47e7d1, 0xbcfde883, 0xbd2c8d4c, 0x3d900565, 0xbd0464c0, 0xbc6c9ad0}},
     {0x3d8c19fb, 0xbf1a2baa, 0x3ea0e519, 0xbf0843ba, 0x3e84aca6, 0x3f354db3, 0x3dce4dfa, 0xbed8d15c, 0x3ea233c1, 0xbe19e467, 0xbf152ae7, 0xbe899eaa},
     {0x3c24d5d8, 0xbb8aebd7, 0xb92b9584, 0xbadbb543, 0x3c2bf9c5, 0x3b242e30, 0x38ccfcbd, 0xbbc3261d, 0xbb32d1e3, 0x3c8c1bc6, 0xbc406c81, 0x3b2a8d4c},
     {0x3a996549, 0x38f0e138, 0x3973e43e, 0x3948b96f, 0x39cd5e4b, 0x383a6c7e, 0x388a3c8d, 0x38b41174, 0x38cba4f1, 0x3a77fc28, 0x3994da95, 0x39f7fc0b}},
    {0.1, 0.3, 0.99, 1e-08, 0.5,
     {0xbeeaa6b0, 0xbf5c1284, 0xbf73e1de, 0xbf0055f0, 0x3f12361c, 0x3ef149e0, 0x3f6361e6, 0xbda70230, 0xbe8cc298, 0x3ee5a008, 0x3eccce98, 0x3f16803c},
     {{0xbd04130e, 0x3d1b09fa, 0xbccdba6b, 0x3d0b8c77, 0x3ce75ed3, 0x3db32503, 0x3d86e250, 0x3db6701c, 0xbce54c75, 0xbd0b7114, 0x3d9a3e34, 0xbcbc3741},
      {0x3ca38e6b, 0xbd6aa773, 0xbd64790d, 0x3db92ca1, 0x3cdf60bd, 0x3bc16651, 0xbc663ce7, 0xbcd25632, 0x3ce2a03a, 0xbc597aa0, 0x3ccf2b02, 0xbdd77080},
      {0x3cf09920, 0xbc086353, 0x3c5c039a, 0x3ca47bd8, 0xbd17b612, 0xbbefa1ab, 0x3d250149, 0x3d72fc27, 0xbd0c951f, 0x3ce9b877, 0x3ce3dcea, 0xbc1c769a}},
     {0xbed4899f, 0xbf37e5ef, 0xbf1bd225, 0xbf30e555, 0x3ebb6888, 0x3e8b851a, 0x3f187de8, 0xbe6a799a, 0xbe03126a, 0x3ef7911b, 0x3e02b3ee, 0x3f405ca2},
     {0x3cba1fc8, 0xbc7d82df, 0xbb7f5105, 0x3d102255, 0xbc96e8f6, 0x3ad5cc69, 0x3cf0d2a5, 0x3d2afdc6, 0xbca3ab7e, 0x3c76661d, 0x3cf1e0ea, 0xbcf796c2},
     {0x37bef228, 0x3846154b, 0x3822af29, 0x38ca0bb5, 0x37f269df, 0x389f1d8d, 0x387e9541, 0x38fa9879, 0x37e2c9ee, 0x37b2330f, 0x38921738, 0x38f28340}},
};

static void adamw_torch(void) {
    int wrong = 0, total = 0;
    for (size_t c = 0; c < sizeof torch_cases / sizeof torch_cases[0]; c++) {
        const torch_case *t = &torch_cases[c];
        float w[12], m[12] = {0}, v[12] = {0};
        for (int i = 0; i < 12; i++) w[i] = f32_from_bits(t->w0[i]);
        for (int step = 1; step <= 3; step++) {
            const ms_adamw_hyper h = {.decay = (float)(1 - t->lr * t->wd), .w1 = (float)(1 - t->beta1),
                                      .b2 = (float)t->beta2, .c2 = (float)(1 - t->beta2),
                                      .step_size = (float)(t->lr / (1 - pow(t->beta1, step))),
                                      .bc2_sqrt = (float)sqrt(1 - pow(t->beta2, step)), .eps = (float)t->eps};
            for (int i = 0; i < 12; i++) ms_adamw_update(&w[i], &m[i], &v[i], f32_from_bits(t->g[step - 1][i]), &h);
        }
        for (int i = 0; i < 12; i++) {
            const int bad = f32_bits(w[i]) != t->w[i] || f32_bits(m[i]) != t->m[i] || f32_bits(v[i]) != t->v[i];
            if (bad)
                fprintf(stderr, "AdamW vs torch, case %zu element %d: w %08x m %08x v %08x, torch %08x %08x %08x\n", c,
                        i, f32_bits(w[i]), f32_bits(m[i]), f32_bits(v[i]), t->w[i], t->m[i], t->v[i]);
            wrong += bad;
            total++;
        }
    }
    printf("AdamW vs PyTorch 2.15's bits: %d of %d elements (3 steps, betas (0.9, 0.95) and (0.3, 0.99)) differ\n",
           wrong, total);
    CHECK(total == 24 && wrong == 0);
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
    adamw();
    adamw_torch();
    sum_sq();
    return check_summary("test_unit_element");
}
