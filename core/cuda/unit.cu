/*
 * unit.cu: the shard units' element-wise arithmetic on device memory (unit_math.h): the
 * scale / divide / accumulate step, the sum of squares and AdamW, one element a thread
 * through the scalar functions the host uses (unit_element.h, unit_math.h), so that a unit
 * on the GPU computes the host's bits.  The sum of squares adds in a fixed order (each
 * thread a grid-stride sum, each block a tree, the host the blocks' partials in block
 * order): deterministic, but not the host's element order.
 */
#include "moonshard.h"
#include "kernels.h"

#include "launch.h"
#include "unit_element.h"

#include <cuda_runtime.h>

namespace {

__global__ void ew_kernel(int op, void *dst, int dd, double s, const void *src, int sd, int round_src, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        ms_ew_element(op, dst, dd, s, src, sd, round_src, i);
}

// partials[b] = the sum of squares of block b's elements (its threads' grid-stride sums, in
// a shared-memory tree).
__global__ void sum_sq_kernel(const void *x, int dt, int64_t n, double *partials) {
    __shared__ double acc[kThreads];
    double s = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const double v = ms_load_f64(x, i, dt);
        s += v * v;
    }
    acc[threadIdx.x] = s;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) acc[threadIdx.x] += acc[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) partials[blockIdx.x] = acc[0];
}

__global__ void adamw_kernel(float *w, float *m, float *v, const void *grad, int gdt, void *stored_out, int sdt,
                             int64_t n, ms_adamw_hyper h) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        ms_adamw_update(&w[i], &m[i], &v[i], ms_load_f32(grad, i, gdt), &h);
        if (stored_out) ms_store_f32(stored_out, i, sdt, w[i]);
    }
}

// torch.optim.AdamW on state of the parameter's own dtype (ms__adamw_torch).
__global__ void adamw_torch_kernel(void *w, void *m, void *v, const void *grad, int dt, int64_t n, ms_adamw_hyper h) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        if (dt == MS_F64) {
            ms_adamw_update_f64(&((double *)w)[i], &((double *)m)[i], &((double *)v)[i], ((const double *)grad)[i], &h);
            continue;
        }
        float a = ms_load_f32(w, i, dt), b = ms_load_f32(m, i, dt), c = ms_load_f32(v, i, dt);
        ms_adamw_update_as(&a, &b, &c, ms_load_f32(grad, i, dt), &h, dt == MS_BF16 ? 1 : dt == MS_F16 ? 2 : 0);
        ms_store_f32(w, i, dt, a);
        ms_store_f32(m, i, dt, b);
        ms_store_f32(v, i, dt, c);
    }
}

} // namespace

extern "C" int ms__cuda_launch_ew(int op, void *dst, int dst_dtype, double s, const void *src, int src_dtype,
                                  int round_src, int64_t n) {
    if (n <= 0) return 0;
    ew_kernel<<<blocks_for(n), kThreads, 0, cudaStreamPerThread>>>(op, dst, dst_dtype, s, src, src_dtype, round_src,
                                                                      n);
    return (int)cudaGetLastError();
}

extern "C" int ms__cuda_launch_sum_sq(const void *x, int dtype, int64_t n, double *partials) {
    sum_sq_kernel<<<MS_CUDA_SUM_BLOCKS, kThreads, 0, cudaStreamPerThread>>>(x, dtype, n, partials);
    return (int)cudaGetLastError();
}

extern "C" int ms__cuda_launch_adamw(float *w, float *m, float *v, const void *grad, int grad_dtype, void *stored_out,
                                     int stored_dtype, int64_t n, const ms_adamw_hyper *h) {
    if (n <= 0) return 0;
    adamw_kernel<<<blocks_for(n), kThreads, 0, cudaStreamPerThread>>>(w, m, v, grad, grad_dtype, stored_out,
                                                                         stored_dtype, n, *h);
    return (int)cudaGetLastError();
}

extern "C" int ms__cuda_launch_adamw_torch(void *w, void *m, void *v, const void *grad, int dtype, int64_t n,
                                           const ms_adamw_hyper *h) {
    if (n <= 0) return 0;
    adamw_torch_kernel<<<blocks_for(n), kThreads, 0, cudaStreamPerThread>>>(w, m, v, grad, dtype, n, *h);
    return (int)cudaGetLastError();
}
