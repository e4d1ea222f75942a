// tandem/core/config.hpp - the few macros that let one source serve g++ and nvcc.
//   struct Scale { float s; TANDEM_HD float operator()(float x) const { return s * x; } };
// Needs: nothing.
#pragma once

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__
#else
#define TANDEM_HD
#endif

#define TANDEM_VERSION_MAJOR 0
#define TANDEM_VERSION_MINOR 1
#define TANDEM_VERSION_PATCH 0
