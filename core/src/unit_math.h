/*
 * unit_math.h: the element-wise arithmetic of the shard units (fsdp.c): scaling and
 * accumulating gradients, their sum of squares, and the AdamW update.  unit_math.c runs it
 * on host memory; core/cuda/unit.cu runs it on device memory (cuda.h: ms__cuda_ew,
 * ms__cuda_sum_sq, ms__cuda_adamw) through the same scalar functions (the AdamW update
 * below, the element-wise step of core/cuda/unit_element.h), so a unit computes the same
 * bits on either side, except for the order of the f64 sum of squares.
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
 * Python scalars are when an f32 kernel takes them. */
typedef struct ms_adamw_hyper {
    float decay;     /* 1 - lr * weight_decay */
    float w1;        /* 1 - beta1: the lerp weight of the first moment */
    float b2, c2;    /* beta2, 1 - beta2 */
    float step_size; /* lr / (1 - beta1^step) */
    float bc2_sqrt;  /* sqrt(1 - beta2^step) */
    float eps;
} ms_adamw_hyper;

/* One element's AdamW update in f32: weight w, moments m and v, gradient g.  PyTorch's
 * single-tensor (and, on the CPU, foreach) AdamW op by op, each a separate rounding unless
 * said otherwise:
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
 * is not (the device code is built without contraction): f32 results are torch's bits.
 * Two known exceptions: torch's CPU sqrt of AVX-512 is not always correctly rounded (about
 * 0.6% of values come out 1 ulp off; sqrtf here is correctly rounded, deliberately), and
 * torch run with ATEN_CPU_CAPABILITY=default does not fuse, 1 ulp apart in places. */
MS_HD static inline void ms_adamw_update(float *w, float *m, float *v, float g, const ms_adamw_hyper *h) {
    const float wd = *w * h->decay;
    const float d = g - *m;
    const float mn = h->w1 < 0.5f ? fmaf(h->w1, d, *m) : fmaf(h->w1 - 1.0f, d, g);
    const float vn = fmaf(h->c2 * g, g, *v * h->b2);
    const float denom = sqrtf(vn) / h->bc2_sqrt + h->eps;
    *w = wd + -h->step_size * mn / denom;
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
#endif

#endif /* MS_UNIT_MATH_H */
