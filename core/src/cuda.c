/*
 * cuda.c: device memory, copies, casts, fills and the shard units' arithmetic through the
 * CUDA runtime (cuda.h), and ms_cuda_device_count.  Every call runs on the calling thread's
 * stream (cudaStreamPerThread) and synchronizes that stream alone before it returns (the
 * enqueue-only cast and fill leave that to ms__cuda_sync): it does not wait for the NCCL
 * backend's communication streams, so a collective in flight on another thread neither
 * blocks it nor is blocked by it.  Without CUDA every call says that moonshard was built
 * without it.
 */
#include "cuda.h"

#include <string.h>

#ifdef MOONSHARD_HAVE_CUDA

#include "../cuda/kernels.h"

#include <cuda_runtime_api.h>
#include <pthread.h>

/* "what: cudaErrorX: the runtime's message"; the thread's last error is cleared, so that
 * the next launch's cudaGetLastError reports that launch alone. */
static ms_status cuda_fail(cudaError_t e, const char *what) {
    cudaGetLastError();
    return ms__fail(e == cudaErrorMemoryAllocation ? MS_ERR_OOM : MS_ERR_DEVICE, "%s: %s: %s", what,
                    cudaGetErrorName(e), cudaGetErrorString(e));
}

#define CUDA_TRY(what, call)                        \
    do {                                            \
        cudaError_t e_ = (call);                    \
        if (e_ != cudaSuccess) return cuda_fail(e_, what); \
    } while (0)

#define SYNC(what) CUDA_TRY(what, cudaStreamSynchronize(cudaStreamPerThread))

ms_status ms_cuda_device_count(int *out) {
    MS_NOT_NULL(out);
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

/* Device memory comes from the device's stream-ordered pool (cudaMallocAsync: ordinary
 * device memory, not managed), because cudaMalloc and cudaFree synchronize the whole device,
 * communication streams included: a free while a collective waits for another rank would
 * wait with it.  The pool keeps what is freed (release threshold: unlimited) instead of
 * handing it back to the driver at every synchronization.  A device or driver without
 * memory pools (cudaDevAttrMemoryPoolsSupported 0), and a device numbered past POOL_DEVICES,
 * use cudaMalloc and cudaFree. */
enum { POOL_DEVICES = 64 };
typedef enum { POOL_UNKNOWN = 0, POOL_YES, POOL_NO } pool_state;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pool_state pools[POOL_DEVICES];

/* Whether `device` (current on this thread) allocates from its pool, set up on first use. */
static ms_status use_pool(int device, bool *yes) {
    *yes = false;
    if (device >= POOL_DEVICES) return MS_OK;
    pthread_mutex_lock(&pool_lock);
    cudaError_t e = cudaSuccess;
    if (pools[device] == POOL_UNKNOWN) {
        int supported = 0;
        cudaMemPool_t pool;
        uint64_t keep = UINT64_MAX;
        e = cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device);
        if (e == cudaSuccess && supported && (e = cudaDeviceGetDefaultMemPool(&pool, device)) == cudaSuccess)
            e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
        if (e == cudaSuccess) pools[device] = supported ? POOL_YES : POOL_NO;
    }
    *yes = pools[device] == POOL_YES;
    pthread_mutex_unlock(&pool_lock);
    return e == cudaSuccess ? MS_OK : cuda_fail(e, "setting up the device's memory pool");
}

ms_status ms__cuda_alloc(int device, int64_t nbytes, void **out) {
    bool pool = false;
    ms_status st = use_device(device);
    if (!st) st = use_pool(device, &pool);
    if (st) return st;
    void *p = NULL;
    cudaError_t e = pool ? cudaMallocAsync(&p, (size_t)nbytes, cudaStreamPerThread) : cudaMalloc(&p, (size_t)nbytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return ms__fail(e == cudaErrorMemoryAllocation ? MS_ERR_OOM : MS_ERR_DEVICE,
                        "cannot allocate %lld bytes on cuda:%d: %s: %s", (long long)nbytes, device,
                        cudaGetErrorName(e), cudaGetErrorString(e));
    }
    e = cudaMemsetAsync(p, 0, (size_t)nbytes, cudaStreamPerThread);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamPerThread);
    if (e != cudaSuccess) {
        ms__cuda_free(device, p);
        return cuda_fail(e, "zeroing new device memory");
    }
    *out = p;
    return MS_OK;
}

/* Every use of the memory has completed (each call synchronizes), so the free needs no wait. */
void ms__cuda_free(int device, void *p) {
    bool pool = false;
    if (!p || use_device(device) || use_pool(device, &pool)) return;
    if ((pool ? cudaFreeAsync(p, cudaStreamPerThread) : cudaFree(p)) != cudaSuccess) cudaGetLastError();
}

ms_status ms__cuda_memcpy(int device, void *dst, const void *src, int64_t nbytes) {
    if (nbytes <= 0) return MS_OK;
    ms_status st = use_device(device);
    if (st) return st;
    CUDA_TRY("copying between host and device",
             cudaMemcpyAsync(dst, src, (size_t)nbytes, cudaMemcpyDefault, cudaStreamPerThread));
    SYNC("copying between host and device");
    return MS_OK;
}

ms_status ms__cuda_cast(int device, void *dst, ms_dtype dst_dtype, const void *src, ms_dtype src_dtype,
                        int64_t n) {
    if (n <= 0) return MS_OK;
    ms_status st = use_device(device);
    if (st) return st;
    if (dst_dtype == src_dtype) {
        if (dst != src)
            CUDA_TRY("copying on the device", cudaMemcpyAsync(dst, src, (size_t)(n * ms_dtype_size(dst_dtype)),
                                                              cudaMemcpyDeviceToDevice, cudaStreamPerThread));
        return MS_OK;
    }
    CUDA_TRY("launching a cast kernel", (cudaError_t)ms__cuda_launch_cast(dst, dst_dtype, src, src_dtype, n));
    return MS_OK;
}

ms_status ms__cuda_fill(int device, void *dst, int64_t n, const void *value, int elem_size) {
    if (n <= 0) return MS_OK;
    ms_status st = use_device(device);
    if (st) return st;
    uint64_t v = 0;
    memcpy(&v, value, (size_t)elem_size); /* little-endian: the element's bytes are v's low bytes */
    CUDA_TRY("launching a fill kernel", (cudaError_t)ms__cuda_launch_fill(dst, n, v, elem_size));
    return MS_OK;
}

ms_status ms__cuda_sync(int device) {
    ms_status st = use_device(device);
    if (st) return st;
    SYNC("running a copy, cast or fill on the device");
    return MS_OK;
}

ms_status ms__cuda_ew(int device, ms_ew_op op, void *dst, ms_dtype dd, double s, const void *src, ms_dtype sd,
                      bool round_src, int64_t n) {
    if (n <= 0) return MS_OK;
    ms_status st = use_device(device);
    if (st) return st;
    CUDA_TRY("launching an element-wise kernel",
             (cudaError_t)ms__cuda_launch_ew((int)op, dst, (int)dd, s, src, (int)sd, round_src, n));
    SYNC("running an element-wise kernel");
    return MS_OK;
}

ms_status ms__cuda_check_pointer(int device, const void *p, int64_t nbytes) {
    if (nbytes <= 0) return MS_OK;
    const char *const ends[2] = {(const char *)p, (const char *)p + nbytes - 1};
    for (int k = 0; k < 2; k++) {
        struct cudaPointerAttributes a;
        cudaError_t e = cudaPointerGetAttributes(&a, ends[k]);
        if (e != cudaSuccess) {
            cudaGetLastError();
            return ms__fail(MS_ERR_DEVICE, "the %s byte of %lld at %p is not memory CUDA knows: %s", k ? "last" : "first",
                            (long long)nbytes, p, cudaGetErrorName(e));
        }
        if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
            return ms__fail(MS_ERR_DEVICE, "the %s byte of %lld at %p is %s memory, not memory of cuda:%d",
                            k ? "last" : "first", (long long)nbytes, p,
                            a.type == cudaMemoryTypeHost ? "pinned host" : "host", device);
        if (a.device != device)
            return ms__fail(MS_ERR_DEVICE, "the %s byte of %lld at %p is memory of cuda:%d, not of cuda:%d",
                            k ? "last" : "first", (long long)nbytes, p, a.device, device);
    }
    return MS_OK;
}

ms_status ms__cuda_sum_sq(int device, const void *x, ms_dtype dt, int64_t n, double *out) {
    *out = 0;
    if (n <= 0) return MS_OK;
    ms_status st = use_device(device);
    if (st) return st;
    double *partials = NULL, host[MS_CUDA_SUM_BLOCKS];
    const size_t bytes = sizeof host;
    if ((st = ms__cuda_alloc(device, (int64_t)bytes, (void **)&partials))) return st;
    cudaError_t e = (cudaError_t)ms__cuda_launch_sum_sq(x, (int)dt, n, partials);
    if (e == cudaSuccess) e = cudaMemcpyAsync(host, partials, bytes, cudaMemcpyDeviceToHost, cudaStreamPerThread);
    if (e == cudaSuccess) e = cudaStreamSynchronize(cudaStreamPerThread);
    ms__cuda_free(device, partials);
    if (e != cudaSuccess) return cuda_fail(e, "summing squares on the device");
    for (int b = 0; b < MS_CUDA_SUM_BLOCKS; b++) *out += host[b];
    return MS_OK;
}

ms_status ms__cuda_adamw(int device, float *w, float *m, float *v, const void *grad, ms_dtype gdt, void *stored_out,
                         ms_dtype sdt, int64_t n, const ms_adamw_hyper *h) {
    if (n <= 0) return MS_OK;
    ms_status st = use_device(device);
    if (st) return st;
    CUDA_TRY("launching the AdamW kernel",
             (cudaError_t)ms__cuda_launch_adamw(w, m, v, grad, (int)gdt, stored_out, (int)sdt, n, h));
    SYNC("running the AdamW kernel");
    return MS_OK;
}

ms_status ms__cuda_adamw_torch(int device, void *w, void *m, void *v, const void *grad, ms_dtype dt, int64_t n,
                               const ms_adamw_hyper *h) {
    if (n <= 0) return MS_OK;
    ms_status st = use_device(device);
    if (st) return st;
    CUDA_TRY("launching the AdamW kernel", (cudaError_t)ms__cuda_launch_adamw_torch(w, m, v, grad, (int)dt, n, h));
    SYNC("running the AdamW kernel");
    return MS_OK;
}

#else /* built without CUDA */

static ms_status not_built(void) {
    return ms__fail(MS_ERR_NOT_BUILT, "moonshard was built without CUDA (the CUDA toolkit was not found "
                                      "when it was configured)");
}

ms_status ms_cuda_device_count(int *out) {
    MS_NOT_NULL(out);
    *out = 0;
    return not_built();
}

ms_status ms__cuda_alloc(int device, int64_t nbytes, void **out) {
    (void)device, (void)nbytes, (void)out;
    return not_built();
}

void ms__cuda_free(int device, void *p) { (void)device, (void)p; }

ms_status ms__cuda_memcpy(int device, void *dst, const void *src, int64_t nbytes) {
    (void)device, (void)dst, (void)src, (void)nbytes;
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

ms_status ms__cuda_sync(int device) {
    (void)device;
    return not_built();
}

ms_status ms__cuda_ew(int device, ms_ew_op op, void *dst, ms_dtype dd, double s, const void *src, ms_dtype sd,
                      bool round_src, int64_t n) {
    (void)device, (void)op, (void)dst, (void)dd, (void)s, (void)src, (void)sd, (void)round_src, (void)n;
    return not_built();
}

ms_status ms__cuda_check_pointer(int device, const void *p, int64_t nbytes) {
    (void)device, (void)p, (void)nbytes;
    return not_built();
}

ms_status ms__cuda_sum_sq(int device, const void *x, ms_dtype dt, int64_t n, double *out) {
    (void)device, (void)x, (void)dt, (void)n;
    *out = 0;
    return not_built();
}

ms_status ms__cuda_adamw(int device, float *w, float *m, float *v, const void *grad, ms_dtype gdt, void *stored_out,
                         ms_dtype sdt, int64_t n, const ms_adamw_hyper *h) {
    (void)device, (void)w, (void)m, (void)v, (void)grad, (void)gdt, (void)stored_out, (void)sdt, (void)n, (void)h;
    return not_built();
}

ms_status ms__cuda_adamw_torch(int device, void *w, void *m, void *v, const void *grad, ms_dtype dt, int64_t n,
                               const ms_adamw_hyper *h) {
    (void)device, (void)w, (void)m, (void)v, (void)grad, (void)dt, (void)n, (void)h;
    return not_built();
}

#endif
