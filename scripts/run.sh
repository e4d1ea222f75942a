#!/usr/bin/env bash
# The main job in one command, after scripts/setup.sh: configures an optimised (Release) build of
# just what it needs (tandemrun and examples/fashion_mnist with the shared-memory and Gloo
# backends, no tests, no CUDA), builds those two targets and trains Fashion-MNIST on 2 ranks
# started by tandemrun. The ranks meet in shared memory (the example's default under a launcher:
# HierarchicalComm<ShmComm, GlooComm>, which on one node is ShmComm alone); `--backend gloo`
# among the flags makes them talk over Gloo's TCP instead.
# Usage: scripts/run.sh [FLAGS...]   the flags go to the example, e.g.
#   scripts/run.sh --checkpoint-dir ckpt            then, after a kill: ... --checkpoint-dir ckpt --resume
#   scripts/run.sh --epochs 1 --tensorboard runs
#   scripts/run.sh --backend gloo                   plain Gloo over loopback TCP (slower)
# Environment: TANDEM_RUN_BUILD_DIR (default build/run), TANDEM_NPROC (ranks, default 2),
# TANDEM_JOBS (build jobs, default every core). Root or not, it needs only a writable build dir.
# Relative paths among the flags are taken from the directory it is started in.
set -euo pipefail
source_dir=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${TANDEM_RUN_BUILD_DIR:-${source_dir}/build/run}
nproc_per_node=${TANDEM_NPROC:-2}
jobs=${TANDEM_JOBS:-$(nproc)}

configure=(
  -DCMAKE_BUILD_TYPE=Release
  -DTANDEM_BUILD_TOOLS=ON -DTANDEM_BUILD_EXAMPLES=ON
  -DTANDEM_WITH_SHM=ON -DTANDEM_WITH_GLOO=ON -DTANDEM_WITH_DATA=ON -DTANDEM_WITH_IO=ON
  -DTANDEM_BUILD_TESTS=OFF -DTANDEM_BUILD_BENCH=OFF -DTANDEM_BUILD_DOCS=OFF
  -DTANDEM_WITH_MPI=OFF -DTANDEM_WITH_CUDA=OFF -DTANDEM_WITH_TORCH=OFF
)
generator=()
# A build directory made before keeps its generator; a new one gets Ninja where it is installed.
if [ ! -f "${build_dir}/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
fi
if ! cmake -S "${source_dir}" -B "${build_dir}" "${generator[@]}" "${configure[@]}"; then
  echo "run.sh: configuring ${build_dir} failed (above); scripts/setup.sh installs what it needs" >&2
  exit 1
fi
cmake --build "${build_dir}" --target tandemrun fashion_mnist -j "${jobs}"

echo "run.sh: ${build_dir}/tools/tandemrun --standalone --nproc-per-node ${nproc_per_node}" \
  "${build_dir}/examples/fashion_mnist/fashion_mnist $*"
exec "${build_dir}/tools/tandemrun" --standalone --nproc-per-node "${nproc_per_node}" \
  "${build_dir}/examples/fashion_mnist/fashion_mnist" "$@"
