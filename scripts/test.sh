#!/usr/bin/env bash
# Configures, builds and runs tandem's whole test suite (CPU tests; CUDA code is compiled when
# nvcc is present and its tests skip, saying so, when no GPU is).
# Usage: scripts/test.sh [preset...]   default: dev asan tsan (CI's 25 minutes on 2 cores); add
# defaults for the default options' build too
#   dev       Debug build, every test, the API reference's warnings, the Conan and vcpkg packages
#   defaults  the README's configuration: tests with every other option at its default (Gloo, MPI
#             off; CUDA compiled where nvcc is); no build type, so unoptimised like Debug, no -g
#   asan      ASan+UBSan build         tsan  ThreadSanitizer build
# The consumer tests (label consumer) build tandem and a user's project afresh with fixed options,
# whatever the preset: dev runs them, the other presets leave them out.
# Debug information is left out (about a fifth of the compile time; CI has 25 minutes on 2 cores):
# a sanitizer report still names functions, not lines. TANDEM_DEBUG_INFO=1 keeps -g (then
# rebuilds what was built without it); `cmake --preset <name>` alone always has it.
set -euo pipefail
cd "$(dirname "$0")/.."

presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(dev asan tsan)
jobs=${TANDEM_JOBS:-$(nproc)}

debug_flags=()
if [ "${TANDEM_DEBUG_INFO:-0}" = 1 ]; then
  debug_flags=(-DCMAKE_CXX_FLAGS_DEBUG=-g -DCMAKE_CUDA_FLAGS_DEBUG=-g)
else
  debug_flags=(-DCMAKE_CXX_FLAGS_DEBUG= -DCMAKE_CUDA_FLAGS_DEBUG=)
fi

for preset in "${presets[@]}"; do
  echo "=== tandem: preset ${preset}"
  cmake --preset "${preset}" "${debug_flags[@]}"
  cmake --build --preset "${preset}" -j "${jobs}"
  ctest --preset "${preset}" -j "${jobs}"
done
