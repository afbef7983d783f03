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
 * are. */
typedef struct ms_adamw_hyper {
    float decay;     /* 1 - lr * weight_decay */
    float b1, b2;    /* beta1, beta2 */
    float c1, c2;    /* 1 - beta1, 1 - beta2 */
    float step_size; /* lr / (1 - beta1^step) */
    float bc2_sqrt;  /* sqrt(1 - beta2^step) */
    float eps;
} ms_adamw_hyper;

/* One element's AdamW update in f32 (PyTorch's single-tensor AdamW, decoupled weight decay
 * first): weight w, moments m and v, gradient g.  Every operation is one IEEE f32 operation
 * in this order (the device code is built without fused multiply-adds). */
MS_HD static inline void ms_adamw_update(float *w, float *m, float *v, float g, const ms_adamw_hyper *h) {
    const float wd = *w * h->decay;
    const float mn = h->b1 * *m + h->c1 * g;
    const float vn = h->b2 * *v + h->c2 * g * g;
    *w = wd - h->step_size * mn / (sqrtf(vn) / h->bc2_sqrt + h->eps);
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
