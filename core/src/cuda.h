/*
 * cuda.h: what the core asks of CUDA (cuda.c, and the kernels of core/cuda/ (kernels.h)).
 *
 * Built with CUDA (MOONSHARD_HAVE_CUDA) these call the CUDA runtime; built without it
 * every call fails with MS_ERR_NOT_BUILT, saying so.  Device pointers are plain pointers
 * (unified addressing): a copy finds out by itself which side each pointer is on.  Every
 * call is synchronous on the device's default stream, so a tensor's memory is ready when
 * a call returns.
 */
#ifndef MS_CUDA_H
#define MS_CUDA_H

#include "ms_internal.h"

/* Zeroed device memory of nbytes (> 0) on device `device`. */
ms_status ms__cuda_alloc(int device, int64_t nbytes, void **out);
void ms__cuda_free(int device, void *p);
/* nbytes from src to dst, either of them host or device memory. */
ms_status ms__cuda_memcpy(void *dst, const void *src, int64_t nbytes);
/* n elements of src_dtype at src to dst_dtype at dst, both on `device`, with the rules of
 * ms_cast (the same scalar functions: cast_scalar.h). */
ms_status ms__cuda_cast(int device, void *dst, ms_dtype dst_dtype, const void *src, ms_dtype src_dtype,
                        int64_t n);
/* n elements of elem_size (1, 2, 4 or 8) bytes at dst set to the bytes at value (host). */
ms_status ms__cuda_fill(int device, void *dst, int64_t n, const void *value, int elem_size);

#endif /* MS_CUDA_H */
