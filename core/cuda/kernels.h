/*
 * kernels.h: the launchers of the CUDA kernels in core/cuda/ (C linkage), called by
 * core/src/cuda.c.  Each launches on the current device, on the calling thread's stream
 * (cudaStreamPerThread), and returns the launch's cudaError_t as an int (0: launched).
 */
#ifndef MS_CUDA_KERNELS_H
#define MS_CUDA_KERNELS_H

#include <stdint.h>

#include "../src/unit_math.h"

#ifdef __cplusplus
extern "C" {
#endif

/* n elements of dtype src_dtype -> dst_dtype (ms_dtype values), the rules of ms_cast. */
int ms__cuda_launch_cast(void *dst, int dst_dtype, const void *src, int src_dtype, int64_t n);
/* n elements of elem_size bytes (1, 2, 4, 8) set to the low elem_size bytes of value. */
int ms__cuda_launch_fill(void *dst, int64_t n, uint64_t value, int elem_size);

/* The shard units' arithmetic (unit_math.h), with the rules of the host's ms__ew,
 * ms__sum_sq and ms__adamw (dtypes as ms_dtype values, op an ms_ew_op). */
int ms__cuda_launch_ew(int op, void *dst, int dst_dtype, double s, const void *src, int src_dtype, int round_src,
                       int64_t n);
/* MS_CUDA_SUM_BLOCKS partial sums of squares (f64) of n elements of x into the device
 * array partials; their sum, in order, is the whole. */
enum { MS_CUDA_SUM_BLOCKS = 256 };
int ms__cuda_launch_sum_sq(const void *x, int dtype, int64_t n, double *partials);
int ms__cuda_launch_adamw(float *w, float *m, float *v, const void *grad, int grad_dtype, void *stored_out,
                          int stored_dtype, int64_t n, const ms_adamw_hyper *h);
/* ms__adamw_torch: w, m, v and grad all of the float dtype dtype. */
int ms__cuda_launch_adamw_torch(void *w, void *m, void *v, const void *grad, int dtype, int64_t n,
                                const ms_adamw_hyper *h);

#ifdef __cplusplus
}
#endif

#endif /* MS_CUDA_KERNELS_H */
