#!/usr/bin/env bash
# scripts/gpu-check.sh - everything tandem can check on a GPU machine, in one command, with a
# dated record: a Release build with CUDA and NCCL (Gloo and MPI where found), every
# `cuda`-labelled test, the same tests' `cuda-sim` builds (the simulated CUDA runtime and NCCL: a
# check that the simulator's tests pass on this machine's compiler and NCCL headers too, where
# a GPU says whether the simulator told the truth), compute-sanitizer memcheck over the device
# tests, NcclComm's suite again
# with the host code under AddressSanitizer, bench/nccl and bench/step with their PyTorch peers,
# and bench/fashion_mnist's GPU run (fashion_mnist_cuda beside PyTorch on one GPU); where
# python3 has PyTorch, the libtorch bridge through scripts/check-libtorch2.sh against its libtorch
# (CPU tests, and torch_bridge_cuda and torch_resnet_cuda on the GPU).
# Writes bench/results/gpu-<date>-<device>.md (device, driver, versions, commit, test counts,
# tables) and prints its path. Without a GPU it says so and exits 77, having built nothing.
#   scripts/gpu-check.sh [--build DIR] [--jobs N] [--no-asan] [--no-memcheck] [--no-bench]
# Dependencies outside the system's paths: CMAKE_PREFIX_PATH and NCCL_ROOT (as set by
# ../shared/gpu/fetch-deps.sh's env.sh). Exit status: 0 when every step passed, 1 otherwise (the
# record is written either way), 77 without a GPU, 2 for a bad argument.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build/gpu-check
jobs=$(nproc)
asan=1
memcheck=1
bench=1
while (($#)); do
  case $1 in
    --build) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --no-asan) asan=0; shift ;;
    --no-memcheck) memcheck=0; shift ;;
    --no-bench) bench=0; shift ;;
    -h | --help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
done
case $build in /*) ;; *) build=$root/$build ;; esac

# --- is there a GPU? ----------------------------------------------------------------------------
# nvidia-smi answers without a CUDA build; a machine without it (or whose driver has no GPU to
# show) gets the reason and 77, the code CTest and our scripts read as "skipped".
gpu_line=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu_line=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    2>/dev/null | head -n 1)
fi
if [[ -z "$gpu_line" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    why="nvidia-smi lists no GPU"
  else
    why="nvidia-smi is not installed (no NVIDIA driver)"
  fi
  echo "gpu-check: SKIPPED: no GPU on this machine ($why); nothing was built or run."
  echo "gpu-check: run it on a machine with an NVIDIA GPU, the CUDA toolkit and NCCL."
  exit 77
fi
IFS=',' read -r gpu_name driver gpu_memory <<<"$gpu_line"
gpu_name=$(echo "$gpu_name" | sed 's/^ *//; s/ *$//')
driver=$(echo "$driver" | tr -d ' ')
gpu_memory=$(echo "$gpu_memory" | sed 's/^ *//')
slug=$(echo "$gpu_name" | tr '[:upper:]' '[:lower:]' | sed 's/nvidia//; s/[^a-z0-9]\+/-/g; s/^-//; s/-$//')
date_utc=$(date -u +%Y-%m-%d)
record=$root/bench/results/gpu-$date_utc-$slug.md
logs=$build/gpu-check-logs
mkdir -p "$logs"
start_seconds=$SECONDS
failures=()
note() { echo "gpu-check: $*"; }

# --- configure and build -------------------------------------------------------------------------
# Gloo and MPI are optional: configure with both, then without MPI, without Gloo, without both.
arch=()
cmake_version=$(cmake --version | head -n 1 | awk '{print $3}')
if printf '%s\n3.24\n' "$cmake_version" | sort -V -C 2>/dev/null; then :; else
  arch=(-DCMAKE_CUDA_ARCHITECTURES=native)  # this GPU only: half the nvcc time
fi
configured=""
for backends in "ON ON" "ON OFF" "OFF ON" "OFF OFF"; do
  read -r gloo mpi <<<"$backends"
  note "configuring (Gloo $gloo, MPI $mpi) in $build"
  rm -f "$build/CMakeCache.txt"
  if cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTANDEM_BUILD_TESTS=ON \
    -DTANDEM_BUILD_BENCH=ON -DTANDEM_BUILD_TOOLS=ON -DTANDEM_BUILD_EXAMPLES=ON -DTANDEM_WITH_CUDA=ON \
    -DTANDEM_WITH_GLOO="$gloo" -DTANDEM_WITH_MPI="$mpi" "${arch[@]}" >"$logs/configure.log" 2>&1; then
    configured="Gloo $gloo, MPI $mpi"
    break
  fi
done
if [[ -z "$configured" ]]; then
  note "FAILED: cmake could not configure a CUDA build; see $logs/configure.log"
  tail -n 30 "$logs/configure.log"
  exit 1
fi
if ! grep -q "tandem: nccl ON" "$logs/configure.log"; then
  note "FAILED: NCCL was not found (set NCCL_ROOT or CMAKE_PREFIX_PATH); see $logs/configure.log"
  exit 1
fi
note "building with $jobs jobs"
build_start=$SECONDS
if ! cmake --build "$build" -j "$jobs" >"$logs/build.log" 2>&1; then
  failures+=("build (see $logs/build.log)")
  tail -n 40 "$logs/build.log"
fi
build_seconds=$((SECONDS - build_start))

# --- tests ---------------------------------------------------------------------------------------
# -L takes a regular expression: '^cuda$' leaves out the cuda-sim tests (run on their own below).
note "ctest -L '^cuda\$'"
(cd "$build" && ctest -L '^cuda$' -V --timeout 900) >"$logs/ctest-cuda.log" 2>&1 ||
  failures+=("ctest -L '^cuda\$'")
cuda_summary=$(grep -E "tests passed|tests failed" "$logs/ctest-cuda.log" | tail -n 1)
# Cases a test reports as skipped inside a run (doctest's own count, in -V output), e.g.
# nccl_comm's two-GPU case on a one-GPU machine.
skipped_cases=$(grep -hE "^\[doctest\] test cases:.*[1-9][0-9]* skipped" "$logs/ctest-cuda.log" | wc -l)

# --- the same tests on the simulated CUDA runtime and NCCL (label cuda-sim; a minute or two) ------
sim_summary="not built (no CUDA or NCCL headers found for the simulator; see configure.log)"
if grep -q "tandem: cuda-sim ON" "$logs/configure.log"; then
  note "ctest -L cuda-sim"
  (cd "$build" && ctest -L '^cuda-sim$' -j "$jobs" --output-on-failure --timeout 900) \
    >"$logs/ctest-cuda-sim.log" 2>&1 || failures+=("ctest -L cuda-sim")
  sim_summary=$(grep -E "tests passed|tests failed" "$logs/ctest-cuda-sim.log" | tail -n 1)
fi

# --- compute-sanitizer memcheck over the device tests -------------------------------------------
# Memory errors only: several tests make failing CUDA calls on purpose (an invalid event, an
# allocation that must fail), which --report-api-errors would list.
memcheck_rows=()
if [[ $memcheck -eq 1 ]]; then
  sanitizer=$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")
  if [[ -x "$sanitizer" ]]; then
    # The flagship's GPU program too, for 30 steps: with the Loader's copies (fp16) and resident
    # (bf16, two ranks sharing the GPU through LocalComm).
    for test in optim_device amp_ema_cuda cuda_exec cuda_dtype nccl_comm ddp_device \
      nn_sync_batch_norm_cuda data_loader_cuda fashion_mnist_cuda fashion_mnist_cuda_resident; do
      args=()
      case $test in
        fashion_mnist_cuda*)
          exe=$build/examples/fashion_mnist/fashion_mnist_cuda
          [[ -x $exe ]] || exe=""
          args=(--epochs 1 --max-steps 30)
          [[ $test == *_resident ]] && args+=(--resident --precision bf16 --backend local --ranks 2)
          ;;
        *) exe=$(find "$build/tests" -type f -name "$test" -perm -u+x | head -n 1) ;;
      esac
      [[ -n "$exe" ]] || { memcheck_rows+=("| $test | not built | - |"); continue; }
      note "memcheck $test"
      t0=$SECONDS
      timeout 240 "$sanitizer" --tool memcheck --report-api-errors no --error-exitcode 99 \
        "$exe" "${args[@]}" >"$logs/memcheck-$test.log" 2>&1
      status=$?
      errors=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p' "$logs/memcheck-$test.log" | tail -n 1)
      case $status in
        0) result="passed" ;;
        77) result="skipped (exit 77)" ;;
        124) result="timed out (240 s)"; failures+=("memcheck $test: timed out") ;;
        99) result="**memory errors**"; failures+=("memcheck $test: memory errors") ;;
        *) result="**failed (exit $status)**"; failures+=("memcheck $test: exit $status") ;;
      esac
      memcheck_rows+=("| $test | $result | ${errors:--} | $((SECONDS - t0)) s |")
    done
  else
    memcheck_rows+=("| (all) | compute-sanitizer not found | - | - |")
  fi
fi

# --- NcclComm with the host code under AddressSanitizer ------------------------------------------
asan_result="not run (--no-asan)"
if [[ $asan -eq 1 ]]; then
  note "nccl_comm with AddressSanitizer"
  if cmake -S "$root" -B "$build-asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DTANDEM_BUILD_TESTS=ON -DTANDEM_WITH_CUDA=ON -DTANDEM_WITH_GLOO=OFF -DTANDEM_WITH_MPI=OFF \
    "${arch[@]}" -DCMAKE_CXX_FLAGS="-fsanitize=address -fno-omit-frame-pointer" \
    -DCMAKE_CUDA_FLAGS="-Xcompiler=-fsanitize=address,-fno-omit-frame-pointer" \
    -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address -DCMAKE_CUDA_LINK_FLAGS=-fsanitize=address \
    >"$logs/asan-configure.log" 2>&1 &&
    cmake --build "$build-asan" -j "$jobs" --target nccl_comm >"$logs/asan-build.log" 2>&1; then
    exe=$(find "$build-asan/tests" -type f -name nccl_comm -perm -u+x | head -n 1)
    # CUDA maps memory where ASan's shadow gap would be; leaks in the driver are not ours.
    ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0 timeout 420 "$exe" >"$logs/asan-nccl_comm.log" 2>&1
    status=$?
    case $status in
      0) asan_result="passed" ;;
      *) asan_result="**failed (exit $status)**, see gpu-check-logs/asan-nccl_comm.log"
        failures+=("nccl_comm under ASan: exit $status") ;;
    esac
  else
    asan_result="**could not build** (see gpu-check-logs/asan-*.log)"
    failures+=("ASan build of nccl_comm")
  fi
fi

# --- the libtorch bridge against the installed PyTorch's libtorch ----------------------------------
torch_result="not run: python3 has no PyTorch"
torch_dir=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null)
if [[ -n $torch_dir && -d $torch_dir/include ]]; then
  note "the libtorch bridge (scripts/check-libtorch2.sh $torch_dir)"
  NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)} \
    "$root/scripts/check-libtorch2.sh" "$torch_dir" "$build-libtorch" >"$logs/libtorch.log" 2>&1
  status=$?
  torch_result=$(sed -n '/^libtorch .*_GLIBCXX_USE_CXX11_ABI=[01]:$/,$p' "$logs/libtorch.log")
  [[ $status -eq 0 ]] || failures+=("the libtorch bridge (see gpu-check-logs/libtorch.log)")
fi

# --- benchmarks ----------------------------------------------------------------------------------
nccl_table=""
step_output=""
fashion_output=""
if [[ $bench -eq 1 ]]; then
  note "bench/nccl"
  if "$root/bench/nccl/run_nccl.sh" "$build" --out "$logs/nccl.md" >"$logs/bench-nccl.log" 2>&1; then
    nccl_table=$(grep -E '^\|' "$logs/nccl.md" || true)
  else
    failures+=("bench/nccl")
    nccl_table="bench/nccl failed: see gpu-check-logs/bench-nccl.log"
  fi
  note "bench/step (host and GPU, with the PyTorch peers)"
  if "$root/bench/step/run_step.sh" "$build" "$build" >"$logs/bench-step.log" 2>&1; then
    step_output=$(grep -vE '^RESULT' "$logs/bench-step.log")
  else
    failures+=("bench/step (a benchmark failed or found its work skipped)")
    step_output="bench/step failed: $(tail -n 5 "$logs/bench-step.log")"
  fi
  note "bench/fashion_mnist on the GPU (fashion_mnist_cuda beside PyTorch)"
  "$root/bench/fashion_mnist/run_fashion_mnist_gpu.sh" "$build" --out "$logs/fashion-mnist-gpu.md" \
    >"$logs/bench-fashion-mnist-gpu.log" 2>&1
  status=$?
  if [[ $status -eq 0 ]]; then
    fashion_output=$(grep -vE '^# ' "$logs/fashion-mnist-gpu.md")
  else
    failures+=("bench/fashion_mnist GPU (exit $status: a run failed or did not train)")
    fashion_output="bench/fashion_mnist failed (exit $status): $(tail -n 8 "$logs/bench-fashion-mnist-gpu.log")"
  fi
fi

# --- the record ----------------------------------------------------------------------------------
commit=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
git -C "$root" diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
nvcc_version=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')
nccl_version=$(sed -n 's/.*Found NCCL: .*found \(suitable \)\?version "\([0-9.]*\)".*/\2/p' \
  "$logs/configure.log" | head -n 1)
torch_version=$(python3 -c "import torch; print(torch.__version__, 'CUDA', torch.version.cuda)" 2>/dev/null || echo "not found")
{
  echo "# tandem on a GPU: $date_utc, $gpu_name"
  echo
  echo "Written by \`scripts/gpu-check.sh\` in $((SECONDS - start_seconds)) s."
  echo
  echo "| | |"
  echo "|---|---|"
  echo "| device | $gpu_name ($gpu_memory), $(nvidia-smi -L | wc -l) GPU(s) |"
  echo "| driver | $driver |"
  echo "| CUDA (nvcc) | ${nvcc_version:-?} |"
  echo "| NCCL | ${nccl_version:-see ctest log} |"
  echo "| compiler | $(${CXX:-c++} --version | head -n 1) |"
  echo "| CMake | $cmake_version; backends: $configured |"
  echo "| PyTorch | $torch_version |"
  echo "| host | $(nproc) cores, $(uname -sr) |"
  echo "| commit | $commit |"
  echo "| build | Release, ${arch[*]:-the project default CUDA architectures}, $build_seconds s with $jobs jobs |"
  echo
  echo "## Tests"
  echo
  echo "\`ctest -L cuda\`: ${cuda_summary:-no summary (see the log)}. Test binaries that reported"
  echo "cases skipped inside a run (doctest): $skipped_cases."
  echo
  echo '```'
  grep -E "Test +#[0-9]+:" "$logs/ctest-cuda.log" | sed 's/^ *//'
  echo '```'
  echo
  echo "\`ctest -L cuda-sim\` (the same sources on the simulated CUDA runtime and NCCL, this"
  echo "machine's compiler and headers): ${sim_summary:-no summary (see the log)}."
  echo
  if [[ $memcheck -eq 1 ]]; then
    echo "## compute-sanitizer memcheck (memory errors only)"
    echo
    echo "| test | result | errors | time |"
    echo "|---|---|---:|---:|"
    printf '%s\n' "${memcheck_rows[@]}"
    echo
  fi
  echo "## nccl_comm with the host code under AddressSanitizer"
  echo
  echo "$asan_result"
  echo
  echo "## The libtorch bridge (scripts/check-libtorch2.sh)"
  echo
  echo '```'
  echo "$torch_result"
  echo '```'
  echo
  if [[ $bench -eq 1 ]]; then
    echo "## bench/nccl"
    echo
    echo "$nccl_table"
    echo
    echo "## bench/step"
    echo
    echo "$step_output"
    echo
    echo "## bench/fashion_mnist on one GPU"
    echo
    echo "$fashion_output"
    echo
  fi
  echo "## Result"
  echo
  if ((${#failures[@]} == 0)); then
    echo "Every step passed."
  else
    echo "Failed:"
    printf -- '- %s\n' "${failures[@]}"
  fi
} >"$record"
note "record: $record ($((SECONDS - start_seconds)) s)"
if ((${#failures[@]} != 0)); then
  note "FAILED: ${failures[*]}"
  exit 1
fi
exit 0
