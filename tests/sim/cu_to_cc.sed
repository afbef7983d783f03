# cu_to_cc.sed: core/cuda/*.cu as C++ for the simulated build (-DMOONSHARD_CUDA_SIM=ON):
# the device shim instead of the CUDA header, and each launch
#   NAME<<<GRID, BLOCK, SHMEM, STREAM>>>(ARGS)  ->  mssim::launch(GRID, BLOCK, SHMEM, STREAM, [=](auto... a_) { NAME(a_...); }, ARGS)
# (NAME may be a template-id; the whole "NAME<<<...>>>(" must be on one line).
s|#include <cuda_runtime.h>|#include "cuda_sim_device.h"|
s/([A-Za-z_][A-Za-z0-9_]*(<[^<>]*>)?)<<<([^>]*)>>>\(/mssim::launch(\3, [=](auto... a_) { \1(a_...); }, /g
