// tandem/cuda/detail/nvcc_only.hpp - the first line of every tandem CUDA header: a translation
// unit that nvcc does not compile stops here, with a message saying what CPU code includes.
//   #include "tandem/cuda/detail/nvcc_only.hpp"
// Needs: nothing. Not a public header.
#pragma once

#if !defined(__CUDACC__)
#error \
    "tandem's CUDA headers are for .cu translation units compiled by nvcc; CPU code includes <tandem/tandem.hpp>"
#endif
