/*
 * cast.cu: ms_cast and fill on the device.
 *
 * Every element goes through the same hub as on the CPU (cast.c), through the very scalar
 * functions the CPU kernels use (cast_element.h, cast_scalar.h), so the bits agree by
 * construction.  The f32 <-> 16- and 8-bit float pairs, the ones training moves, have
 * kernels of their own that take 4 elements a thread; every other pair uses one generic
 * kernel that switches on the dtypes (uniform across a warp).
 */
#include "moonshard.h"
#include "kernels.h"

#include "cast_element.h"
#include "launch.h"

#include <cuda_runtime.h>

namespace {

__global__ void cast_generic(void *dst, int dt, const void *src, int sdt, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        ms_cast_element(dst, dt, src, sdt, i);
}

// ---------------------------------------------------------------- f32 <-> narrow floats

// Four elements loaded and stored as one vector.
template <typename T> struct alignas(4 * sizeof(T)) Vec4 { T v[4]; };

// 4 elements a thread, as one vector load and one vector store, when both sides are
// aligned to 4 elements; else one element a thread.
template <typename S, typename D, D (*F)(S)>
__global__ void cast_pair(D *dst, const S *src, int64_t n, bool vec4) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (vec4) {
        const Vec4<S> *s4 = reinterpret_cast<const Vec4<S> *>(src);
        Vec4<D> *d4 = reinterpret_cast<Vec4<D> *>(dst);
        for (int64_t q = i; q < n / 4; q += stride) {
            Vec4<S> a = s4[q];
            Vec4<D> b;
            for (int k = 0; k < 4; k++) b.v[k] = F(a.v[k]);
            d4[q] = b;
        }
        for (int64_t j = n / 4 * 4 + i; j < n; j += stride) dst[j] = F(src[j]); // the tail
        return;
    }
    for (; i < n; i += stride) dst[i] = F(src[i]);
}

__device__ uint16_t to_bf16(float x) { return f32_to_bf16(x); }
__device__ uint16_t to_f16(float x) { return f32_to_f16(x); }
__device__ uint8_t to_e4m3(float x) { return f32_to_e4m3(x); }
__device__ uint8_t to_e5m2(float x) { return f32_to_e5m2(x); }
__device__ float from_bf16(uint16_t x) { return bf16_to_f32(x); }
__device__ float from_f16(uint16_t x) { return f16_to_f32(x); }
__device__ float from_e4m3(uint8_t x) { return e4m3_to_f32(x); }
__device__ float from_e5m2(uint8_t x) { return e5m2_to_f32(x); }

template <typename S, typename D, D (*F)(S)>
void launch_pair(void *dst, const void *src, int64_t n) {
    const bool vec4 = ((uintptr_t)dst % (4 * sizeof(D))) == 0 && ((uintptr_t)src % (4 * sizeof(S))) == 0;
    cast_pair<S, D, F><<<blocks_for(vec4 ? (n + 3) / 4 : n), kThreads, 0, cudaStreamPerThread>>>(
        static_cast<D *>(dst), static_cast<const S *>(src), n, vec4);
}

// ---------------------------------------------------------------- fill

template <typename T> __global__ void fill_kernel(T *dst, int64_t n, T v) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = v;
}

template <typename T> void launch_fill(void *dst, int64_t n, uint64_t value) {
    fill_kernel<<<blocks_for(n), kThreads, 0, cudaStreamPerThread>>>(static_cast<T *>(dst), n, (T)value);
}

} // namespace

extern "C" int ms__cuda_launch_cast(void *dst, int dst_dtype, const void *src, int src_dtype, int64_t n) {
    if (n <= 0) return 0;
    if (src_dtype == MS_F32) {
        switch (dst_dtype) {
        case MS_BF16: launch_pair<float, uint16_t, to_bf16>(dst, src, n); return (int)cudaGetLastError();
        case MS_F16: launch_pair<float, uint16_t, to_f16>(dst, src, n); return (int)cudaGetLastError();
        case MS_F8E4M3: launch_pair<float, uint8_t, to_e4m3>(dst, src, n); return (int)cudaGetLastError();
        case MS_F8E5M2: launch_pair<float, uint8_t, to_e5m2>(dst, src, n); return (int)cudaGetLastError();
        default: break;
        }
    } else if (dst_dtype == MS_F32) {
        switch (src_dtype) {
        case MS_BF16: launch_pair<uint16_t, float, from_bf16>(dst, src, n); return (int)cudaGetLastError();
        case MS_F16: launch_pair<uint16_t, float, from_f16>(dst, src, n); return (int)cudaGetLastError();
        case MS_F8E4M3: launch_pair<uint8_t, float, from_e4m3>(dst, src, n); return (int)cudaGetLastError();
        case MS_F8E5M2: launch_pair<uint8_t, float, from_e5m2>(dst, src, n); return (int)cudaGetLastError();
        default: break;
        }
    }
    cast_generic<<<blocks_for(n), kThreads, 0, cudaStreamPerThread>>>(dst, dst_dtype, src, src_dtype, n);
    return (int)cudaGetLastError();
}

extern "C" int ms__cuda_launch_fill(void *dst, int64_t n, uint64_t value, int elem_size) {
    if (n <= 0) return 0;
    switch (elem_size) {
    case 1: launch_fill<uint8_t>(dst, n, value); break;
    case 2: launch_fill<uint16_t>(dst, n, value); break;
    case 4: launch_fill<uint32_t>(dst, n, value); break;
    default: launch_fill<uint64_t>(dst, n, value); break;
    }
    return (int)cudaGetLastError();
}
