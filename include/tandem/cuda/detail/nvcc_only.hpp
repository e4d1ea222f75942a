// tandem/cuda/detail/nvcc_only.hpp - the first line of every tandem CUDA header: a translation
// unit that nvcc does not compile stops here, with a message saying what CPU code includes. The
// one exception is tandem's own simulated CUDA runtime (tests/cuda_sim, which defines
// TANDEM_CUDA_SIM): there the host compiler builds the CUDA parts against the real CUDA headers,
// and cuda_exec runs its functors as host functions on the stream (tandem/cuda/exec.hpp).
//   #include "tandem/cuda/detail/nvcc_only.hpp"
// Needs: nothing. Not a public header.
#pragma once

#if !defined(__CUDACC__) && !defined(TANDEM_CUDA_SIM)
#error \
    "tandem's CUDA headers are for .cu translation units compiled by nvcc; CPU code includes <tandem/tandem.hpp>"
#endif
