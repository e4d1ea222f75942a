#!/usr/bin/env bash
# Configures, builds and runs tandem's whole test suite (CPU tests; CUDA code is compiled when
# nvcc is present and its tests skip, saying so, when no GPU is).
# Usage: scripts/test.sh [preset...]   default: dev asan tsan (CI's 25 minutes on 2 cores); add
# defaults for the default options' build too
#   dev       Debug build, every test, the API reference's warnings, the Conan and vcpkg packages
#   defaults  the README's configuration: tests with every other option at its default (Gloo, MPI
#             off; CUDA compiled where nvcc is); no build type, so unoptimised like Debug, no -g
#   asan      ASan+UBSan build         tsan  ThreadSanitizer build
# With no preset named (CI), each CPU test room is built in one of dev, asan and tsan (below);
# a preset named on the command line builds and runs every room.
# The consumer tests (label consumer) build tandem and a user's project afresh with fixed options,
# whatever the preset: dev runs them, the other presets leave them out.
# Debug information is left out (about a fifth of the compile time; CI has 25 minutes on 2 cores):
# a sanitizer report still names functions, not lines. TANDEM_DEBUG_INFO=1 keeps -g (then
# rebuilds what was built without it); `cmake --preset <name>` alone always has it.
set -euo pipefail
cd "$(dirname "$0")/.."

presets=("$@")
split_rooms=0
if [ ${#presets[@]} -eq 0 ]; then
  presets=(dev asan tsan)
  split_rooms=1
fi
jobs=${TANDEM_JOBS:-$(nproc)}
# Most tests wait (for ranks to meet, a timeout to pass, processes to start) far more than they
# compute: at one test a core, CI's tsan tests kept its 2 cores 30 % busy. So tests run two a
# core; a test that is itself parallel (a build, N ranks) claims its cores (CTest PROCESSORS).
test_jobs=${TANDEM_TEST_JOBS:-$((jobs * 2))}

debug_flags=()
if [ "${TANDEM_DEBUG_INFO:-0}" = 1 ]; then
  debug_flags=(-DCMAKE_CXX_FLAGS_DEBUG=-g -DCMAKE_CUDA_FLAGS_DEBUG=-g)
else
  debug_flags=(-DCMAKE_CXX_FLAGS_DEBUG= -DCMAKE_CUDA_FLAGS_DEBUG=)
fi

# CI's default run builds each CPU test room once, in the preset where it finds the most:
# ThreadSanitizer the rooms whose code runs threads and processes against each other, ASan+UBSan
# the rooms that parse, index and compute over buffers, dev the rest (CUDA, libtorch, consumers,
# packaging, interop, docs, examples) and every room a later change adds. The CUDA tests of every
# room build in dev, the one preset with nvcc. The GPU tests on the simulated CUDA runtime and NCCL
# (label cuda-sim, tests/cuda_sim), whatever their room, are split the same way: those whose ranks
# are threads of one process (and the simulator's own) in tsan, where ThreadSanitizer sees the
# ranks meet; those whose ranks are processes (NcclComm under tandemrun and mpirun, the CUDA
# example) in dev; ASan+UBSan builds none. Presets named on the command line build every room and
# every simulator test.
tsan_rooms="unit/comm;unit/local;unit/ddp;unit/gloo;unit/mpi;unit/shm;unit/hierarchical;unit/init;unit/launch;unit/data;unit/rendezvous;fault"
asan_rooms="unit/core;unit/tensor;unit/arena;unit/amp;unit/optim;unit/ema;unit/nn;unit/io;fuzz"
# The rooms and the simulator tests a preset builds: every one when presets are named, else its
# share of CI's split (above).
split_flags() {
  local rooms="-DTANDEM_TEST_ROOMS= -DTANDEM_TEST_SKIP_ROOMS="
  local sim="-DTANDEM_CUDA_SIM=AUTO -DTANDEM_CUDA_SIM_TESTS=all"
  if [ "${split_rooms}" = 1 ]; then
    case "$1" in
      tsan)
        rooms="-DTANDEM_TEST_ROOMS=${tsan_rooms} -DTANDEM_TEST_SKIP_ROOMS="
        sim="-DTANDEM_CUDA_SIM=AUTO -DTANDEM_CUDA_SIM_TESTS=threads" ;;
      asan)
        rooms="-DTANDEM_TEST_ROOMS=${asan_rooms} -DTANDEM_TEST_SKIP_ROOMS="
        sim="-DTANDEM_CUDA_SIM=OFF" ;;
      *)
        rooms="-DTANDEM_TEST_ROOMS= -DTANDEM_TEST_SKIP_ROOMS=${tsan_rooms};${asan_rooms}"
        sim="-DTANDEM_CUDA_SIM=AUTO -DTANDEM_CUDA_SIM_TESTS=processes" ;;
    esac
  fi
  echo "${rooms} ${sim}"
}

for preset in "${presets[@]}"; do
  echo "=== tandem: preset ${preset}"
  # shellcheck disable=SC2046  # the flags are words without spaces
  cmake --preset "${preset}" "${debug_flags[@]}" $(split_flags "${preset}")
  cmake --build --preset "${preset}" -j "${jobs}"
  ctest --preset "${preset}" -j "${test_jobs}"
done
