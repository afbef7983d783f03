/*
 * unit_math.h: the element-wise arithmetic of the shard units (unit.c, unit_adamw.c):
 * scaling and accumulating gradients, their sum of squares, and the AdamW update.
 * unit_math.c runs it on host memory; core/cuda/unit.cu runs it on device memory (cuda.h:
 * ms__cuda_ew, ms__cuda_sum_sq, ms__cuda_adamw) through the same scalar functions (the
 * AdamW update below, the element-wise step of core/cuda/unit_element.h), so a unit
 * computes the same bits on either side, except for the order of the f64 sum of squares.
 *
 * The rules are PyTorch's opmath: a 16- or 8-bit value is widened to f32, computed in f32
 * and rounded once into its dtype; f64 computes in f64.
 */
#ifndef MS_UNIT_MATH_H
#define MS_UNIT_MATH_H

#include "cast_scalar.h"

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

typedef enum ms_ew_op {
    MS_EW_MUL, /* dst *= s */
    MS_EW_DIV, /* dst /= s */
    MS_EW_ADD  /* dst += src (src first rounded to dst's dtype when round_src) */
} ms_ew_op;

/* One AdamW step's scalars, rounded to f32 from the double hyper-parameters as PyTorch's
 * Python scalars are when an f32 (or 16-bit: opmath f32) kernel takes them, and kept in
 * f64 for f64 parameters. */
typedef struct ms_adamw_hyper {
    float decay;     /* 1 - lr * weight_decay */
    float w1;        /* 1 - beta1: the lerp weight of the first moment */
    float b2, c2;    /* beta2, 1 - beta2 */
    float step_size; /* lr / (1 - beta1^step) */
    float bc2_sqrt;  /* sqrt(1 - beta2^step) */
    float eps;
    struct {
        double decay, w1, b2, c2, step_size, bc2_sqrt, eps;
    } d; /* the same in f64 */
} ms_adamw_hyper;

/* How a unit keeps AdamW's state (ms_unit_set_adamw): the values of MS_ADAMW_MASTER and
 * MS_ADAMW_TORCH (moonshard.h). */
enum { MS__ADAMW_MASTER = 0, MS__ADAMW_TORCH = 1 };

/* x rounded to the dtype of its storage, for the 16-bit kinds: 0 none (f32), 1 bf16, 2 f16. */
MS_HD static inline float ms_round16(float x, int kind) {
    return kind == 1 ? bf16_to_f32(f32_to_bf16(x)) : kind == 2 ? f16_to_f32(f32_to_f16(x)) : x;
}

/* One element's AdamW update in f32 (opmath): weight w, moments m and v, gradient g, each
 * a value of the dtype `kind` names (0 f32, 1 bf16, 2 f16; ms_round16).  PyTorch's
 * single-tensor (and, on the CPU, foreach) AdamW op by op, each a separate rounding to that
 * dtype unless said otherwise:
 *   param.mul_(1 - lr * weight_decay)
 *   exp_avg.lerp_(grad, 1 - beta1)         ATen's lerp: weight < 0.5 ? self + weight * (end -
 *                                          self) : end - (end - self) * (1 - weight)
 *   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
 *   denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
 *   param.addcdiv_(exp_avg, denom, value=-step_size)
 * PyTorch's CPU kernels for AVX2 and AVX-512 (the dispatch any x86-64 CPU of the last decade
 * gets) and its CUDA kernels fuse the multiply-add of the lerp and of the addcmul into one
 * fused multiply-add (one rounding; the lerp's large-weight branch as end + (weight - 1) *
 * (end - self), the same value), so these two are fmaf here, which every other operation
 * is not (the device code is built without contraction).  Every Python scalar reaches the
 * kernels in f32 except eps, which the add of a scalar to a 16-bit tensor rounds to the
 * tensor's dtype first.  f32 results are torch's bits, and bf16 and f16 ones too (the
 * state kept in those dtypes: torch.optim.AdamW on 16-bit parameters), measured in
 * tests/c/test_adamw_torch.c against tests/reference/data/adamw.txt.  Two known
 * exceptions: torch's CPU sqrt is Intel MKL's, which is not always correctly rounded (f32
 * on MKL's AVX-512 code, 0.65% of values 1 ulp off; f64 on every dispatch; sqrtf here is
 * correctly rounded, deliberately, as torch's CUDA sqrt is: torch with
 * MKL_ENABLE_INSTRUCTIONS=AVX2 gives these bits in f32), and torch run with
 * ATEN_CPU_CAPABILITY=default does not fuse (2,900 of the test's 25,600 values differ then). */
MS_HD static inline void ms_adamw_update_as(float *w, float *m, float *v, float g, const ms_adamw_hyper *h, int kind) {
    const float wd = ms_round16(*w * h->decay, kind);
    const float d = g - *m;
    const float mn = ms_round16(h->w1 < 0.5f ? fmaf(h->w1, d, *m) : fmaf(h->w1 - 1.0f, d, g), kind);
    const float vn = ms_round16(fmaf(h->c2 * g, g, ms_round16(*v * h->b2, kind)), kind);
    const float sq = ms_round16(ms_round16(sqrtf(vn), kind) / h->bc2_sqrt, kind);
    const float denom = ms_round16(sq + ms_round16(h->eps, kind), kind);
    *w = ms_round16(wd + -h->step_size * mn / denom, kind);
    *m = mn;
    *v = vn;
}

/* The f32 update: master weights and moments in f32 (or an f32 parameter). */
MS_HD static inline void ms_adamw_update(float *w, float *m, float *v, float g, const ms_adamw_hyper *h) {
    ms_adamw_update_as(w, m, v, g, h, 0);
}

/* The same in f64 for f64 parameters (torch.optim.AdamW on them: f64 state, the scalars in
 * f64, the lerp's and the addcmul's multiply-adds fused). */
MS_HD static inline void ms_adamw_update_f64(double *w, double *m, double *v, double g, const ms_adamw_hyper *h) {
    const double wd = *w * h->d.decay;
    const double d = g - *m;
    const double mn = h->d.w1 < 0.5 ? fma(h->d.w1, d, *m) : fma(h->d.w1 - 1.0, d, g);
    const double vn = fma(h->d.c2 * g, g, *v * h->d.b2);
    const double denom = sqrt(vn) / h->d.bc2_sqrt + h->d.eps;
    *w = wd + -h->d.step_size * mn / denom;
    *m = mn;
    *v = vn;
}

#ifndef __CUDACC__
#include "moonshard.h"

/* n elements of dst (a float dtype dd) updated by op, with s (MUL, DIV) or src (ADD, dtype
 * sd). */
void ms__ew(ms_ew_op op, void *dst, ms_dtype dd, double s, const void *src, ms_dtype sd, bool round_src, int64_t n);
/* The sum of squares of n elements of a float dtype, in f64, in element order. */
double ms__sum_sq(const void *x, ms_dtype dt, int64_t n);
/* AdamW on n elements: w (f32 weights: the master copy, or the parameter when stored is
 * f32), m, v; grad of gdt; when stored_out is not NULL the new weights are also cast into
 * it (dtype sdt: the stored parameter of a master copy). */
void ms__adamw(float *w, float *m, float *v, const void *grad, ms_dtype gdt, void *stored_out, ms_dtype sdt,
               int64_t n, const ms_adamw_hyper *h);
/* torch.optim.AdamW on n elements kept in the parameter's own float dtype dt: the weights
 * w, moments m, v and gradient all of dt (ms_adamw_update_as; f64: ms_adamw_update_f64). */
void ms__adamw_torch(void *w, void *m, void *v, const void *grad, ms_dtype dt, int64_t n, const ms_adamw_hyper *h);
/* The 16-bit kind of ms_round16 for dt: 1 bf16, 2 f16, else 0. */
static inline int ms__round16_kind(ms_dtype dt) { return dt == MS_BF16 ? 1 : dt == MS_F16 ? 2 : 0; }
#endif

#endif /* MS_UNIT_MATH_H */
