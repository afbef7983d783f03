/*
 * sim.h: a host simulation of the CUDA runtime and of NCCL, for testing moonshard's device
 * code paths (core/src/cuda.c, the kernels of core/cuda, core/src/comm_nccl.c, the shard
 * units on cuda tensors) on a machine without a GPU.  It checks the plumbing (pointers, sizes,
 * streams, events, ordering, error paths), never the GPU: a build against it
 * (-DMOONSHARD_CUDA_SIM=ON) is a test build, never one to train with.
 *
 * The model, chosen so that the mistakes a real GPU punishes fail here deterministically:
 *  - Device memory is host memory that the host cannot touch: a device pointer is the host
 *    address plus kTag (a non-canonical address on x86-64, so a host dereference faults),
 *    and every API call checks that the ranges it is given lie inside one live allocation.
 *  - Streams run lazily: work enqueued on a stream runs only when someone waits for it
 *    (cudaStreamSynchronize, an event query, a synchronous copy, cudaFree, ...), in stream
 *    order.  A result read before the wait that orders it reads stale data.
 *  - Kernels (the .cu files of core/cuda compiled as C++ with cuda_sim_device.h) run on the
 *    host when their stream runs: every block, every thread, __syncthreads through fibers.
 *  - Gated stream operations (enqueue_gated): the stream's progress stops at one until it
 *    says it is done; a query (cudaEventQuery, cudaStreamQuery) tries it once and says
 *    cudaErrorNotReady while it is not, a blocking wait tries it again after short sleeps.
 *    That is how a collective waits for its peers without blocking a polling host thread,
 *    as a GPU spinning in a kernel would not.
 *  - NCCL: communicators of one or several ranks, one rank a process of the same machine
 *    (their data through POSIX shared memory), nonblocking as configured.
 *
 * Internal to tests/sim: what the runtime (cudart_sim.cc) offers NCCL (nccl_sim.cc) and the
 * kernel launcher (cuda_sim_device.h).
 */
#ifndef MS_SIM_H
#define MS_SIM_H

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>

namespace mssim {

// A device pointer is the host address + kTag.
constexpr uintptr_t kTag = uintptr_t(1) << 62;

// The host memory behind [p, p + bytes) of device memory, or nullptr when that range is not
// inside one live device allocation (then *device is untouched).  bytes 0: p may be the
// allocation's end.  *device (when not null) gets the allocation's device.
// An allocation is no longer live once cudaFree or cudaFreeAsync was called on it, even
// while the stream-ordered free itself has not run yet: translate pointers when the work is
// enqueued, not when it runs.
void *host_of(const void *p, size_t bytes, int *device = nullptr);

// Whether p points into a live device allocation.
bool is_device(const void *p);

// The calling thread's current device (cudaSetDevice; 0 until set).
int current_device();

// Enqueues op on stream s in stream order; 0 and cudaStreamPerThread are the calling
// thread's per-thread stream.  op runs when the stream is waited for, on the waiting
// thread.  Returns cudaErrorInvalidResourceHandle for a stream that is not live (and does
// not set the last error: the caller decides).  op may run on any thread (the one that
// waits), so it must not use the runtime's per-thread state (stream 0, the current device,
// the last error); it may drain other streams (as cudaStreamWaitEvent's operation does), but
// never wait for a later operation of its own stream.
cudaError_t enqueue(cudaStream_t s, std::function<void()> op);

// Enqueues a gated operation on s: when the stream reaches it, try_run is called (on the
// thread that waits for the stream, as op above) until it returns true; meanwhile nothing
// after it on s runs.  cudaEventQuery and cudaStreamQuery call it once a query and answer
// cudaErrorNotReady while it returns false; blocking waits (cudaStreamSynchronize,
// cudaEventSynchronize, synchronous copies, cudaFree, ...) call it again after a short sleep
// until it returns true (forever, if it never does).  try_run must not block: it looks,
// perhaps does part of its work, and says whether it is done; it keeps its own state between
// calls.  Same rules as op otherwise; cudaErrorInvalidResourceHandle as enqueue.
cudaError_t enqueue_gated(cudaStream_t s, std::function<bool()> try_run);

// Runs every operation enqueued on s so far (what cudaStreamSynchronize does).
// cudaErrorInvalidResourceHandle (not set as the last error) for a stream that is not live.
cudaError_t drain(cudaStream_t s);

// Sets the calling thread's last error (cudaGetLastError / cudaPeekAtLastError report it).
void set_last_error(cudaError_t e);

} // namespace mssim

#endif /* MS_SIM_H */
