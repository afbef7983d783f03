/*
 * kernels.h: the launchers of the CUDA kernels in core/cuda/ (C linkage), called by
 * core/src/cuda.c.  Each launches on the current device's default stream and returns the
 * launch's cudaError_t as an int (0: launched).
 */
#ifndef MS_CUDA_KERNELS_H
#define MS_CUDA_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* n elements of dtype src_dtype -> dst_dtype (ms_dtype values), the rules of ms_cast. */
int ms__cuda_launch_cast(void *dst, int dst_dtype, const void *src, int src_dtype, int64_t n);
/* n elements of elem_size bytes (1, 2, 4, 8) set to the low elem_size bytes of value. */
int ms__cuda_launch_fill(void *dst, int64_t n, uint64_t value, int elem_size);

#ifdef __cplusplus
}
#endif

#endif /* MS_CUDA_KERNELS_H */
