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
# --deadline S: a step not begun S seconds after the start is skipped and named in the record
# (device time is short: the record must come back even when not everything fits). The build
# goes in two stages: first what the `cuda` tests, the benchmarks and the libtorch bridge need,
# the rest (the simulator's tests) only before the step that runs them. --out-dir DIR: the
# record and a tarball of the logs are copied there at the end.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$root/build/gpu-check
jobs=$(nproc)
asan=1
memcheck=1
bench=1
deadline=0
out_dir=""
while (($#)); do
  case $1 in
    --build) build=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --no-asan) asan=0; shift ;;
    --no-memcheck) memcheck=0; shift ;;
    --no-bench) bench=0; shift ;;
    --deadline) deadline=$2; shift 2 ;;
    --out-dir) out_dir=$2; shift 2 ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
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
skipped=()
note() { echo "gpu-check: $*"; }
# may_start STEP: false (and STEP named in the record) once the deadline has passed.
may_start() {
  if ((deadline > 0 && SECONDS - start_seconds >= deadline)); then
    skipped+=("$1")
    note "skipped (the ${deadline} s deadline passed): $1"
    return 1
  fi
}
# step_limit: seconds a step may run: until two minutes past the deadline (at least 30), so that
# the record is still written before the caller's own limit; an hour without a deadline.
step_limit() {
  if ((deadline > 0)); then
    local left=$((start_seconds + deadline + 120 - SECONDS))
    echo $((left > 30 ? left : 30))
  else
    echo 3600
  fi
}

# --- configure and build -------------------------------------------------------------------------
# Gloo and MPI are optional: configure with both, then without MPI, without Gloo, without both.
arch=()
cmake_version=$(cmake --version | head -n 1 | awk '{print $3}')
if printf '%s\n3.24\n' "$cmake_version" | sort -V -C 2>/dev/null; then :; else
  arch=("-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native}")  # this GPU only: half the nvcc time
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
# --- the libtorch bridge against the installed PyTorch's libtorch, beside the build -------------
# Its CUDA steps alone (the CPU ones run on any machine): two nvcc translation units, one job,
# while the build below takes the other cores.
torch_result="not run: python3 has no PyTorch"
torch_pid=""
torch_dir=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))' 2>/dev/null)
if [[ -n $torch_dir && -d $torch_dir/include ]]; then
  note "the libtorch bridge's CUDA steps (scripts/check-libtorch2.sh --only cuda $torch_dir)"
  NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)} \
    "$root/scripts/check-libtorch2.sh" --only cuda "$torch_dir" "$build-libtorch" \
    >"$logs/libtorch.log" 2>&1 &
  torch_pid=$!
fi

# First what the `cuda` tests, the benchmarks and the GPU example need; the rest (the simulator's
# tests) later, before they run.
first_targets=()
while read -r test_name; do
  [[ $test_name == compile_fail_* ]] && continue  # a target that must not compile
  ninja -C "$build" -t query "$test_name" >/dev/null 2>&1 && first_targets+=("$test_name")
done < <(cd "$build" && ctest -L '^cuda$' -N | sed -n 's/^ *Test *#[0-9]*: *//p')
for target in tandemrun bench_nccl bench_step bench_step_cuda fashion_mnist_cuda; do
  ninja -C "$build" -t query "$target" >/dev/null 2>&1 && first_targets+=("$target")
done
note "building ${#first_targets[@]} targets with $jobs jobs: ${first_targets[*]}"
build_start=$SECONDS
if ! cmake --build "$build" -j "$jobs" --target "${first_targets[@]}" >"$logs/build.log" 2>&1; then
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

# --- the libtorch bridge's result (started beside the build) --------------------------------------
if [[ -n $torch_pid ]]; then
  wait "$torch_pid"
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
  if ! may_start "bench/nccl"; then
    nccl_table="not run (deadline)"
  elif timeout "$(step_limit)" "$root/bench/nccl/run_nccl.sh" "$build" --out "$logs/nccl.md" >"$logs/bench-nccl.log" 2>&1; then
    nccl_table=$(grep -E '^\|' "$logs/nccl.md" || true)
  else
    failures+=("bench/nccl")
    nccl_table="bench/nccl failed: see gpu-check-logs/bench-nccl.log"
  fi
  note "bench/step (host and GPU, with the PyTorch peers)"
  if ! may_start "bench/step"; then
    step_output="not run (deadline)"
  elif timeout "$(step_limit)" "$root/bench/step/run_step.sh" "$build" "$build" >"$logs/bench-step.log" 2>&1; then
    step_output=$(grep -vE '^RESULT' "$logs/bench-step.log")
  else
    failures+=("bench/step (a benchmark failed or found its work skipped)")
    step_output="bench/step failed: $(tail -n 5 "$logs/bench-step.log")"
  fi
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
      [[ -n "$exe" ]] || { memcheck_rows+=("| $test | not built | - | - |"); continue; }
      may_start "memcheck $test" || { memcheck_rows+=("| $test | not run (deadline) | - | - |"); continue; }
      note "memcheck $test"
      t0=$SECONDS
      limit=$(step_limit)
      ((limit < 240)) || limit=240
      timeout "$limit" "$sanitizer" --tool memcheck --report-api-errors no --error-exitcode 99 \
        "$exe" "${args[@]}" >"$logs/memcheck-$test.log" 2>&1
      status=$?
      errors=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) error.*/\1/p' "$logs/memcheck-$test.log" | tail -n 1)
      case $status in
        0) result="passed" ;;
        77) result="skipped (exit 77)" ;;
        124) result="timed out ($limit s)"; failures+=("memcheck $test: timed out") ;;
        99) result="**memory errors**"; failures+=("memcheck $test: memory errors") ;;
        *) result="**failed (exit $status)**"; failures+=("memcheck $test: exit $status") ;;
      esac
      memcheck_rows+=("| $test | $result | ${errors:--} | $((SECONDS - t0)) s |")
    done
  else
    memcheck_rows+=("| (all) | compute-sanitizer not found | - | - |")
  fi
fi

# --- the GPU example beside PyTorch (the longest benchmark: last) -----------------------------
if [[ $bench -eq 1 ]]; then
  note "bench/fashion_mnist on the GPU (fashion_mnist_cuda beside PyTorch)"
  status=0
  may_start "bench/fashion_mnist" &&
    timeout "$(step_limit)" "$root/bench/fashion_mnist/run_fashion_mnist_gpu.sh" "$build" --out "$logs/fashion-mnist-gpu.md" \
    >"$logs/bench-fashion-mnist-gpu.log" 2>&1
  status=$?
  if ((${#skipped[@]})) && [[ ${skipped[-1]} == bench/fashion_mnist ]]; then
    fashion_output="not run (deadline)"
  elif [[ $status -eq 0 ]]; then
    fashion_output=$(grep -vE '^# ' "$logs/fashion-mnist-gpu.md")
  else
    failures+=("bench/fashion_mnist GPU (exit $status: a run failed or did not train)")
    fashion_output="bench/fashion_mnist failed (exit $status): $(tail -n 8 "$logs/bench-fashion-mnist-gpu.log")"
  fi
fi

# --- the same tests on the simulated CUDA runtime and NCCL (label cuda-sim; a minute or two) ------
sim_summary="not built (no CUDA or NCCL headers found for the simulator, or the deadline passed; see configure.log)"
if grep -q "tandem: cuda-sim ON" "$logs/configure.log" && may_start "the rest of the build and ctest -L cuda-sim"; then
  note "building the rest (the simulator's tests)"
  cmake --build "$build" -j "$jobs" >>"$logs/build.log" 2>&1 || failures+=("build of the rest (see $logs/build.log)")
  note "ctest -L cuda-sim"
  (cd "$build" && timeout "$(step_limit)" ctest -L '^cuda-sim$' -j "$jobs" --output-on-failure --timeout 900) \
    >"$logs/ctest-cuda-sim.log" 2>&1 || failures+=("ctest -L cuda-sim")
  sim_summary=$(grep -E "tests passed|tests failed" "$logs/ctest-cuda-sim.log" | tail -n 1)
fi

# --- NcclComm with the host code under AddressSanitizer ------------------------------------------
asan_result="not run (--no-asan, or the deadline passed)"
if [[ $asan -eq 1 ]] && may_start "nccl_comm under AddressSanitizer"; then
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
    ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0 timeout "$(step_limit)" "$exe" >"$logs/asan-nccl_comm.log" 2>&1
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
  if ((${#skipped[@]})); then
    echo "Not run: the ${deadline} s deadline had passed before these steps:"
    printf -- '- %s\n' "${skipped[@]}"
    echo
  fi
  if ((${#failures[@]} == 0)); then
    echo "Every step that ran passed."
  else
    echo "Failed:"
    printf -- '- %s\n' "${failures[@]}"
  fi
} >"$record"
note "record: $record ($((SECONDS - start_seconds)) s)"
if [[ -n $out_dir ]]; then
  mkdir -p "$out_dir"
  cp "$record" "$out_dir/"
  mkdir -p "$logs/libtorch"
  cp "$build-libtorch"/*.log "$logs/libtorch/" 2>/dev/null
  tar -czf "$out_dir/gpu-check-logs.tar.gz" -C "$build" gpu-check-logs
fi
if ((${#failures[@]} != 0)); then
  note "FAILED: ${failures[*]}"
  exit 1
fi
exit 0
