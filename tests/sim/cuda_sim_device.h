/*
 * cuda_sim_device.h: what the kernels of core/cuda (the .cu files) need to compile as C++
 * against the simulated runtime (sim.h): the build (tests/sim/cu_to_cc.sed) includes this
 * header instead of <cuda_runtime.h> and turns every launch
 *     NAME<<<GRID, BLOCK, SHMEM, STREAM>>>(ARGS)
 * into
 *     mssim::launch(GRID, BLOCK, SHMEM, STREAM, [=](auto... a_) { NAME(a_...); }, ARGS)
 *
 * A kernel is then an ordinary host function.  The launch checks what a real launch checks
 * (the configuration, the stream, the pointer arguments), translates the pointer arguments
 * from device addresses to the host memory behind them, and enqueues one operation on the
 * stream; when the stream runs, that operation calls the kernel once for every thread of
 * every block, with threadIdx, blockIdx, blockDim and gridDim set (thread-locals of the
 * running host thread).  __shared__ variables are static thread_local: one copy for the
 * blocks that host thread runs, one block after another.  __syncthreads works through
 * fibers (cudart_sim.cc, run_grid): a block whose thread 0 never reaches a barrier runs its
 * threads as plain calls, one after the other; otherwise every thread of the block is a
 * fiber, run round robin from barrier to barrier.  A barrier some threads of a block skip
 * (undefined on a GPU) aborts the process with a message naming the block and thread.
 *
 * Not simulated: warps (and so the warp intrinsics), dynamic shared memory (extern
 * __shared__), atomics, and pointers inside struct arguments (they are not translated: a
 * kernel that follows one dereferences a tagged address and faults).
 */
#ifndef MS_CUDA_SIM_DEVICE_H
#define MS_CUDA_SIM_DEVICE_H

#ifndef __cplusplus
#error "cuda_sim_device.h is C++: the kernels of core/cuda/ compiled for the simulated device"
#endif

#include <cuda_runtime_api.h>
#include <vector_types.h>

#include "sim.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

/* crt/host_defines.h (through cuda_runtime_api.h) defined these for host code already, most
 * as nothing; they are set here to what a kernel compiled for the host needs. */
#undef __global__
#undef __device__
#undef __host__
#undef __forceinline__
#undef __shared__
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local

/* The running thread's coordinates, set by the simulated device (cudart_sim.cc) before each
 * call of a kernel.  Inline definitions of hidden visibility rather than extern
 * declarations, for speed: a kernel reads them in every iteration, and an extern
 * thread_local of class type (dim3) is read through a call of its TLS wrapper function,
 * one of default visibility in a shared library through a full __tls_get_addr lookup (a
 * 2^22-element kernel took 100 ms so, 30 ms thus).  So the kernels and cudart_sim.cc must
 * be linked into the same module (libmoonshard): another module has copies of its own. */
#define MSSIM_HIDDEN __attribute__((visibility("hidden")))
MSSIM_HIDDEN inline thread_local uint3 threadIdx, blockIdx;
MSSIM_HIDDEN inline thread_local dim3 blockDim, gridDim;

/* The block's barrier: every thread of the block reaches it before any goes on.  Outside a
 * kernel, or reached by only some threads of a block, it aborts with a message. */
void __syncthreads();

namespace mssim {
namespace detail {

/* The host address behind a kernel's pointer argument: null stays null; *ok becomes false
 * when p is neither null nor device memory of the calling thread's current device. */
void *kernel_pointer(const void *p, bool *ok);

/* cudaSuccess, or what a launch of that shape on stream s fails with (a bad configuration,
 * a stream that is not live or not of the current device). */
cudaError_t launch_check(dim3 grid, dim3 block, size_t shmem, cudaStream_t s);

/* Runs every thread of every block of the grid on the calling host thread: thread(ctx) runs
 * the thread threadIdx says, rest(ctx) every thread of the block but thread 0.  what names
 * the launch in messages (__PRETTY_FUNCTION__). */
void run_grid(dim3 grid, dim3 block, void (*thread)(void *), void (*rest)(void *), void *ctx, const char *what);

template <class T> T translate(T v, bool *ok) {
    if constexpr (std::is_pointer_v<T> && !std::is_function_v<std::remove_pointer_t<T>>)
        return reinterpret_cast<T>(kernel_pointer((const void *)v, ok));
    else
        return v;
}

/* A launch's kernel and translated arguments, as its operation holds them. */
template <class F, class... A> struct Kernel {
    F f;
    std::tuple<A...> args;
    static void thread(void *self) {
        Kernel *k = static_cast<Kernel *>(self);
        std::apply(k->f, k->args);
    }
    /* Every thread of the block but thread 0, one after the other: the loop a block without
     * barriers runs, here where the kernel inlines into it (no call a thread). */
    static void rest(void *self) {
        Kernel *k = static_cast<Kernel *>(self);
        const dim3 b = blockDim;
        for (unsigned z = 0; z < b.z; z++)
            for (unsigned y = 0; y < b.y; y++)
                for (unsigned x = y || z ? 0 : 1; x < b.x; x++) {
                    threadIdx = uint3{x, y, z};
                    std::apply(k->f, k->args);
                }
    }
};

} // namespace detail

/* NAME<<<grid, block, shmem, s>>>(args...) with f calling NAME.  As with a real launch, a
 * failure is reported by cudaGetLastError (and nothing is enqueued). */
template <class F, class... A> void launch(dim3 grid, dim3 block, size_t shmem, cudaStream_t s, F f, A... args) {
    cudaError_t e = detail::launch_check(grid, block, shmem, s);
    if (e != cudaSuccess) {
        set_last_error(e);
        return;
    }
    bool ok = true;
    detail::Kernel<F, A...> k{f, std::tuple<A...>(detail::translate(args, &ok)...)};
    if (!ok) { /* a host pointer, a freed one, another device's memory */
        set_last_error(cudaErrorInvalidValue);
        return;
    }
    const char *what = __PRETTY_FUNCTION__;
    e = enqueue(s, [k, grid, block, what]() mutable {
        detail::run_grid(grid, block, &detail::Kernel<F, A...>::thread, &detail::Kernel<F, A...>::rest, &k, what);
    });
    if (e != cudaSuccess) set_last_error(e);
}

} // namespace mssim

#endif /* MS_CUDA_SIM_DEVICE_H */
