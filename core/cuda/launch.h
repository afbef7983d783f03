/*
 * launch.h: the launch shape of the kernels of core/cuda/: kThreads threads a block and a
 * grid-stride loop over at most blocks_for(n) blocks.  Every kernel runs on the calling
 * thread's stream (cudaStreamPerThread), which does not wait for the NCCL backend's
 * communication streams (they are non-blocking streams).
 */
#ifndef MS_CUDA_LAUNCH_H
#define MS_CUDA_LAUNCH_H

#include <cstdint>

namespace {

constexpr int kThreads = 256;

// Enough blocks for one element a thread, at most 4 * 65535 (the grid-stride loops do the rest).
inline int blocks_for(int64_t n) {
    int64_t b = (n + kThreads - 1) / kThreads;
    return (int)(b < 1 ? 1 : b > 65535 * 4 ? 65535 * 4 : b);
}

} // namespace

#endif /* MS_CUDA_LAUNCH_H */
