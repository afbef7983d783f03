/*
 * cuda.c: device memory, copies, casts and fills through the CUDA runtime (cuda.h), and
 * ms_cuda_device_count.  Without CUDA every call says that moonshard was built without it.
 */
#include "cuda.h"

#include <string.h>

#ifdef MOONSHARD_HAVE_CUDA

#include "../cuda/kernels.h"

#include <cuda_runtime_api.h>

/* "what: cudaErrorX: the runtime's message" */
static ms_status cuda_fail(cudaError_t e, const char *what) {
    return ms__fail(e == cudaErrorMemoryAllocation ? MS_ERR_OOM : MS_ERR_DEVICE, "%s: %s: %s", what,
                    cudaGetErrorName(e), cudaGetErrorString(e));
}

#define CUDA_TRY(what, call)                        \
    do {                                            \
        cudaError_t e_ = (call);                    \
        if (e_ != cudaSuccess) return cuda_fail(e_, what); \
    } while (0)

ms_status ms_cuda_device_count(int *out) {
    if (!out) return ms__fail(MS_ERR_ARG, "cuda_device_count: out is NULL");
    *out = 0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* not sticky: leave the runtime clean */
        return ms__fail(MS_ERR_DEVICE, "no CUDA device: cudaGetDeviceCount: %s: %s", cudaGetErrorName(e),
                        cudaGetErrorString(e));
    }
    *out = n;
    return n > 0 ? ms__ok() : ms__fail(MS_ERR_DEVICE, "no CUDA device: cudaGetDeviceCount found 0");
}

/* Makes `device` current on this thread, with a message naming it when it is not there. */
static ms_status use_device(int device) {
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) return MS_OK;
    cudaGetLastError();
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        n = 0;
    }
    return ms__fail(MS_ERR_DEVICE, "device cuda:%d: %s: %s (this machine has %d CUDA device%s)", device,
                    cudaGetErrorName(e), cudaGetErrorString(e), n, n == 1 ? "" : "s");
}

ms_status ms__cuda_alloc(int device, int64_t nbytes, void **out) {
    ms_status st = use_device(device);
    if (st) return st;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, (size_t)nbytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return ms__fail(e == cudaErrorMemoryAllocation ? MS_ERR_OOM : MS_ERR_DEVICE,
                        "cannot allocate %lld bytes on cuda:%d: %s: %s", (long long)nbytes, device,
                        cudaGetErrorName(e), cudaGetErrorString(e));
    }
    e = cudaMemset(p, 0, (size_t)nbytes);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        cudaFree(p);
        return cuda_fail(e, "zeroing new device memory");
    }
    *out = p;
    return MS_OK;
}

void ms__cuda_free(int device, void *p) {
    if (!p || use_device(device)) return;
    cudaFree(p);
}

ms_status ms__cuda_memcpy(void *dst, const void *src, int64_t nbytes) {
    if (nbytes <= 0) return MS_OK;
    CUDA_TRY("copying between host and device", cudaMemcpy(dst, src, (size_t)nbytes, cudaMemcpyDefault));
    CUDA_TRY("copying between host and device", cudaDeviceSynchronize()); /* device to device */
    return MS_OK;
}

ms_status ms__cuda_cast(int device, void *dst, ms_dtype dst_dtype, const void *src, ms_dtype src_dtype,
                        int64_t n) {
    if (n <= 0) return MS_OK;
    ms_status st = use_device(device);
    if (st) return st;
    if (dst_dtype == src_dtype) {
        if (dst != src) { /* a device-to-device memcpy does not wait for itself: synchronize */
            CUDA_TRY("copying on the device",
                     cudaMemcpy(dst, src, (size_t)(n * ms_dtype_size(dst_dtype)), cudaMemcpyDeviceToDevice));
            CUDA_TRY("copying on the device", cudaDeviceSynchronize());
        }
        return MS_OK;
    }
    CUDA_TRY("launching a cast kernel", (cudaError_t)ms__cuda_launch_cast(dst, dst_dtype, src, src_dtype, n));
    CUDA_TRY("running a cast kernel", cudaDeviceSynchronize());
    return MS_OK;
}

ms_status ms__cuda_fill(int device, void *dst, int64_t n, const void *value, int elem_size) {
    if (n <= 0) return MS_OK;
    ms_status st = use_device(device);
    if (st) return st;
    uint64_t v = 0;
    memcpy(&v, value, (size_t)elem_size); /* little-endian: the element's bytes are v's low bytes */
    CUDA_TRY("launching a fill kernel", (cudaError_t)ms__cuda_launch_fill(dst, n, v, elem_size));
    CUDA_TRY("running a fill kernel", cudaDeviceSynchronize());
    return MS_OK;
}

#else /* built without CUDA */

static ms_status not_built(void) {
    return ms__fail(MS_ERR_NOT_BUILT, "moonshard was built without CUDA (the CUDA toolkit was not found "
                                      "when it was configured)");
}

ms_status ms_cuda_device_count(int *out) {
    if (out) *out = 0;
    return not_built();
}

ms_status ms__cuda_alloc(int device, int64_t nbytes, void **out) {
    (void)device, (void)nbytes, (void)out;
    return not_built();
}

void ms__cuda_free(int device, void *p) { (void)device, (void)p; }

ms_status ms__cuda_memcpy(void *dst, const void *src, int64_t nbytes) {
    (void)dst, (void)src, (void)nbytes;
    return not_built();
}

ms_status ms__cuda_cast(int device, void *dst, ms_dtype dst_dtype, const void *src, ms_dtype src_dtype,
                        int64_t n) {
    (void)device, (void)dst, (void)dst_dtype, (void)src, (void)src_dtype, (void)n;
    return not_built();
}

ms_status ms__cuda_fill(int device, void *dst, int64_t n, const void *value, int elem_size) {
    (void)device, (void)dst, (void)n, (void)value, (void)elem_size;
    return not_built();
}

#endif
