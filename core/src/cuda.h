/*
 * cuda.h: what the core asks of CUDA (cuda.c, and the kernels of core/cuda/ (kernels.h)).
 *
 * Built with CUDA (MOONSHARD_HAVE_CUDA) these call the CUDA runtime; built without it
 * every call fails with MS_ERR_NOT_BUILT, saying so.  Device pointers are plain pointers
 * (unified addressing): a copy finds out by itself which side each pointer is on.  Every
 * call runs on the calling thread's stream (cudaStreamPerThread) and, except the enqueue-only
 * cast and fill, waits for it, so a tensor's memory is ready when a call returns; none waits
 * for another thread's work or for the communication streams (memory comes from the
 * stream-ordered pool: cudaMalloc and cudaFree would synchronize the whole device).
 */
#ifndef MS_CUDA_H
#define MS_CUDA_H

#include "ms_internal.h"
#include "unit_math.h"

/* Zeroed device memory of nbytes (> 0) on device `device`, from its stream-ordered pool. */
ms_status ms__cuda_alloc(int device, int64_t nbytes, void **out);
/* MS_OK when the nbytes at p (its first and last byte) are memory of CUDA device `device`
 * (device or managed memory), else MS_ERR_DEVICE saying what they are. */
ms_status ms__cuda_check_pointer(int device, const void *p, int64_t nbytes);
void ms__cuda_free(int device, void *p);
/* nbytes from src to dst, either of them host or device memory (of `device`). */
ms_status ms__cuda_memcpy(int device, void *dst, const void *src, int64_t nbytes);
/* Enqueued only, for the many runs of a strided copy or fill: ms__cuda_sync(device) waits
 * for them (and reports a failure of the kernels).
 * n elements of src_dtype at src to dst_dtype at dst, both on `device`, with the rules of
 * ms_cast (the same scalar functions: cast_scalar.h). */
ms_status ms__cuda_cast(int device, void *dst, ms_dtype dst_dtype, const void *src, ms_dtype src_dtype,
                        int64_t n);
/* n elements of elem_size (1, 2, 4 or 8) bytes at dst set to the bytes at value (host). */
ms_status ms__cuda_fill(int device, void *dst, int64_t n, const void *value, int elem_size);
ms_status ms__cuda_sync(int device);
/* The shard units' arithmetic on device memory of `device`, with the rules of the host's
 * ms__ew, ms__sum_sq and ms__adamw (unit_math.h).  The sum of squares adds in its own fixed
 * order. */
ms_status ms__cuda_ew(int device, ms_ew_op op, void *dst, ms_dtype dd, double s, const void *src, ms_dtype sd,
                      bool round_src, int64_t n);
ms_status ms__cuda_sum_sq(int device, const void *x, ms_dtype dt, int64_t n, double *out);
ms_status ms__cuda_adamw(int device, float *w, float *m, float *v, const void *grad, ms_dtype gdt, void *stored_out,
                         ms_dtype sdt, int64_t n, const ms_adamw_hyper *h);
ms_status ms__cuda_adamw_torch(int device, void *w, void *m, void *v, const void *grad, ms_dtype dt, int64_t n,
                               const ms_adamw_hyper *h);

#endif /* MS_CUDA_H */
