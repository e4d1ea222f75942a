#!/usr/bin/env bash
# Configures, builds and runs tandem's whole test suite (CPU tests; CUDA code is compiled when
# nvcc is present and its tests skip, saying so, when no GPU is).
# Usage: scripts/test.sh [preset...]   default: dev asan tsan
#   dev   Debug build, every test          asan  ASan+UBSan build     tsan  ThreadSanitizer build
set -euo pipefail
cd "$(dirname "$0")/.."

presets=("$@")
[ ${#presets[@]} -gt 0 ] || presets=(dev asan tsan)
jobs=${TANDEM_JOBS:-$(nproc)}

for preset in "${presets[@]}"; do
  echo "=== tandem: preset ${preset}"
  cmake --preset "${preset}"
  cmake --build --preset "${preset}" -j "${jobs}"
  ctest --preset "${preset}" -j "${jobs}"
done
