#!/usr/bin/env bash
# Builds and runs the libtorch bridge's tests (tests/unit/torch) and examples/torch_resnet against
# the libtorch inside a PyTorch 2.x wheel, by hand: no CMake, since find_package(Torch) pointed at
# a wheel on a machine with Debian's libtorch-dev still picked /usr/lib's libtorch 1.13, and the
# wheel's Caffe2 config asks for the CUDA libraries its libtorch_cuda was built with.
# NOT run by CI (CI builds against Debian's 1.13 through CMake); run it by hand after a change to
# include/tandem/torch/ and record the result in docs/libtorch.md ("Supported versions").
#   scripts/check-libtorch2.sh [--only cpu|cuda] TORCH_DIR [BUILD_DIR]
# --only cuda compiles and runs the CUDA steps alone (gpu-check.sh, where device time is short);
# --only cpu the CPU steps alone.
# TORCH_DIR holds the wheel's include/ and lib/: the wheel's torch/ folder unzipped (unzip the
# .whl's torch/include, torch/lib and torch/share/cmake), or an installed PyTorch's
#   python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))'
# BUILD_DIR (default build/libtorch2) receives objects, executables and logs.
# The CPU steps link libtorch_cpu and libc10 only, never libtorch.so, which needs libtorch_cuda
# and its CUDA libraries; a CUDA wheel's libtorch_cpu itself still needs libcudart and libcupti
# (ldd is shown, and nothing runs when a library is missing). Where the wheel has CUDA
# (libc10_cuda.so) and nvcc is here (NVCC, else /usr/local/cuda/bin/nvcc), the CUDA steps compile
# tests/unit/torch/ddp_cuda_test.cu and examples/torch_resnet/torch_resnet_cuda.cu with nvcc
# (CUDA_ARCH, default 90), link them against libtorch_cuda, libc10_cuda and NCCL (CUDA libraries
# that libtorch_cuda needs and this machine lacks are let through with --allow-shlib-undefined),
# and run them where a GPU is (each exits 77, SKIP, without one). Gloo is linked before libtorch_cpu: the
# wheel's libtorch_cpu exports its own gloo symbols, which would otherwise bind in place of the
# system libgloo's (GlooComm then fails to listen). Gloo, MPI and zlib are optional (their tests
# are skipped without them). Each step prints PASS, FAIL or SKIP; the exit status is 1 when one
# failed. Compiles one translation unit at a time (about 30-60 s each, 2 GB).
set -uo pipefail
steps=cpu,cuda
if [[ ${1:-} == --only ]]; then
  case ${2:-} in
    cpu | cuda) steps=$2 ;;
    *) echo "$0: --only takes cpu or cuda, not '${2:-}'" >&2; exit 2 ;;
  esac
  shift 2
fi
[[ $# -ge 1 && -d ${1}/include && -d ${1}/lib ]] || {
  echo "usage: $0 TORCH_DIR [BUILD_DIR]  (TORCH_DIR holds the wheel's include/ and lib/)" >&2
  exit 2
}
torch_dir=$(cd "$1" && pwd)
source_dir=$(cd "$(dirname "$0")/.." && pwd)
build_dir=${2:-${source_dir}/build/libtorch2}
mkdir -p "$build_dir"
build_dir=$(cd "$build_dir" && pwd)
cxx=${CXX:-c++}
results=()
failed=0
record() {  # record STATUS WHAT
  results+=("$1  $2")
  echo "== $1: $2"
  [[ $1 == FAIL ]] && failed=1
  return 0
}

# The version, and the C++ ABI its libc10 was built with (the new one since about 2.7).
version_h=""
for v in include/torch/headeronly/version.h include/torch/csrc/api/include/torch/version.h; do
  [[ -f $torch_dir/$v ]] && { version_h=$torch_dir/$v; break; }
done
version=$(awk '/define TORCH_VERSION_(MAJOR|MINOR|PATCH) /{printf "%s%s", sep, $3; sep="."}' \
  "$version_h" 2>/dev/null)
abi=0
# (grep reads all of nm's output: with -q, nm's SIGPIPE would fail the pipeline.)
nm -DC "$torch_dir/lib/libc10.so" 2>/dev/null | grep 'torchCheckFail.*__cxx11' >/dev/null && abi=1
echo "libtorch ${version:-unknown} at $torch_dir (_GLIBCXX_USE_CXX11_ABI=$abi); $($cxx --version | head -1)"

torch_includes=(-isystem "$torch_dir/include" -isystem "$torch_dir/include/torch/csrc/api/include")
flags=(-std=gnu++20 "-D_GLIBCXX_USE_CXX11_ABI=$abi" -Wall -Wextra -Wpedantic -Werror
  -Wno-error=restrict -I"$source_dir/include")
# shellcheck disable=SC2054  # the commas belong to the linker flags
torch_libs=(-L"$torch_dir/lib" -Wl,--no-as-needed -ltorch_cpu -lc10 -Wl,--as-needed
  -Wl,-rpath,"$torch_dir/lib" -lpthread)

# Optional: Debian's libgloo-dev, an MPI with mpicxx, zlib.
gloo=()
for lib in /usr/lib/libgloo.so /usr/lib/x86_64-linux-gnu/libgloo.so /usr/local/lib/libgloo.so; do
  [[ -e $lib ]] && { gloo=("$lib"); break; }
done
mpi_compile=() mpi_link=()
if command -v mpicxx >/dev/null 2>&1 && command -v mpiexec >/dev/null 2>&1; then
  read -r -a mpi_compile <<<"$(mpicxx --showme:compile 2>/dev/null)"
  read -r -a mpi_link <<<"$(mpicxx --showme:link 2>/dev/null)"
  mpi_compile=("${mpi_compile[@]/#-I/-isystem}" -DOMPI_SKIP_MPICXX -DMPICH_SKIP_MPICXX)
  for f in "${mpi_link[@]}"; do [[ $f == -L* ]] && mpi_link+=("-Wl,-rpath,${f#-L}"); done
fi
zlib=()
echo 'int main(){}' | $cxx -x c++ - -lz -o "$build_dir/zlib_probe" 2>/dev/null && zlib=(-lz)

# compile NAME SOURCE FLAGS...: an object, and a FAIL when a header came from another libtorch
# (a header the wheel lacks would silently be found under /usr/include).
compile() {
  local name=$1 source=$2
  shift 2
  echo "-- compiling $source"
  if ! $cxx "${flags[@]}" "$@" "${torch_includes[@]}" -MD -MF "$build_dir/$name.d" \
    -c "$source_dir/$source" -o "$build_dir/$name.o" >"$build_dir/$name.log" 2>&1; then
    grep -E 'error|required from here' "$build_dir/$name.log" | head -20
    record FAIL "compile $source against libtorch $version (log: $build_dir/$name.log)"
    return 1
  fi
  local foreign
  foreign=$(tr ' ' '\n' <"$build_dir/$name.d" | tr -d '\134' | grep -E '/(torch|ATen|c10|caffe2)/' |
    grep "^/" | grep -vE "^($torch_dir|$source_dir)/" | head -3)
  if [[ -n $foreign ]]; then
    record FAIL "compile $source: headers from outside $torch_dir: $foreign"
    return 1
  fi
  record PASS "compile $source against libtorch $version"
}
link() {  # link NAME OBJECTS_AND_LIBS...
  local name=$1
  shift
  if $cxx -o "$build_dir/$name" "$@" >"$build_dir/$name.link.log" 2>&1; then
    # The rpath must win over the system's libtorch (Debian's libtorch1.13, for one).
    local loaded
    loaded=$(ldd "$build_dir/$name" | awk '$1 == "libtorch_cpu.so" {print $3}')
    if [[ $loaded != "$torch_dir/lib/libtorch_cpu.so" ]]; then
      record FAIL "link $name: it loads libtorch_cpu.so from '${loaded:-nowhere}'"
      return 1
    fi
    record PASS "link $name (loads $loaded)"
  else
    head -20 "$build_dir/$name.link.log"
    record FAIL "link $name (log: $build_dir/$name.link.log)"
    return 1
  fi
}
run() {  # run WHAT COMMAND...: PASS on 0, SKIP on 77, else FAIL
  local what=$1 status=0
  shift
  echo "-- running $what"
  "$@" >"$build_dir/run.log" 2>&1 || status=$?
  tail -4 "$build_dir/run.log"
  cp "$build_dir/run.log" "$build_dir/$(echo "$what" | tr -c 'A-Za-z0-9_\n' '_').log"
  case $status in
    0) record PASS "$what" ;;
    77) record SKIP "$what" ;;
    *) record FAIL "$what (exit $status)" ;;
  esac
}

# The tools the tests start (no libtorch in them).
$cxx "${flags[@]}" "$source_dir/tools/tandemrun.cpp" -o "$build_dir/tandemrun" -ldl ||
  record FAIL "compile tools/tandemrun.cpp"
$cxx "${flags[@]}" "$source_dir/tools/tandem_ckpt.cpp" -o "$build_dir/tandem-ckpt" ||
  record FAIL "compile tools/tandem_ckpt.cpp"
$cxx "${flags[@]}" -c "$source_dir/tests/support/doctest_main.cpp" -o "$build_dir/doctest_main.o" ||
  record FAIL "compile tests/support/doctest_main.cpp"

if [[ $steps == *cpu* ]]; then
  # torch_bridge: as tests/unit/torch/CMakeLists.txt builds it (with the io component).
  test_flags=(-I"$source_dir/tests" -DTANDEM_TEST_IO=1
    "-DTANDEM_REFERENCE_DIR=\"$source_dir/tests/reference\"")
  bridge_ok=1
  compile ddp_test tests/unit/torch/ddp_test.cpp "${test_flags[@]}" || bridge_ok=0
  compile sync_batch_norm_test tests/unit/torch/sync_batch_norm_test.cpp "${test_flags[@]}" ||
    bridge_ok=0
  ((bridge_ok)) && link torch_bridge "$build_dir/doctest_main.o" "$build_dir/ddp_test.o" \
    "$build_dir/sync_batch_norm_test.o" "${torch_libs[@]}" || bridge_ok=0

  # torch_processes: with whichever of Gloo and MPI is here.
  processes_flags=(-I"$source_dir/tests")
  ((${#gloo[@]})) && processes_flags+=(-DTANDEM_TEST_GLOO=1)
  ((${#mpi_link[@]})) && processes_flags+=(-DTANDEM_TEST_MPI=1 "${mpi_compile[@]}")
  processes_ok=0
  if ((${#gloo[@]} + ${#mpi_link[@]})); then
    compile processes_test tests/unit/torch/processes_test.cpp "${processes_flags[@]}" &&
      link torch_processes "$build_dir/doctest_main.o" "$build_dir/processes_test.o" "${gloo[@]}" \
        "${mpi_link[@]}" "${torch_libs[@]}" && processes_ok=1
  else
    record SKIP "tests/unit/torch/processes_test.cpp (neither Gloo nor MPI here)"
  fi

  # examples/torch_resnet: needs zlib (the data component); Gloo for its crash-and-resume test.
  example_flags=(-I"$source_dir/examples")
  ((${#gloo[@]})) && example_flags+=(-DTANDEM_EXAMPLE_WITH_GLOO=1)
  ((${#mpi_link[@]})) && example_flags+=(-DTANDEM_EXAMPLE_WITH_MPI=1 "${mpi_compile[@]}")
  example_ok=0
  if ((${#zlib[@]})); then
    compile torch_resnet examples/torch_resnet/torch_resnet.cpp "${example_flags[@]}" &&
      link torch_resnet "$build_dir/torch_resnet.o" "${gloo[@]}" "${mpi_link[@]}" "${zlib[@]}" \
        "${torch_libs[@]}" && example_ok=1
  else
    record SKIP "examples/torch_resnet (no zlib)"
  fi

  # Running needs every library libtorch_cpu asks for (a CUDA wheel's asks for libcudart and
  # libcupti even on a CPU-only path).
  echo "-- ldd libtorch_cpu.so (libraries outside the system's):"
  ldd "$torch_dir/lib/libtorch_cpu.so" | grep -vE '=> /(usr/)?lib(64)?/|linux-vdso|ld-linux'
  missing=$(ldd "$torch_dir/lib/libtorch_cpu.so" | awk '/not found/{print $1}' | tr '\n' ' ')
  if [[ -n $missing ]]; then
    record SKIP "running: libtorch_cpu.so needs libraries not found here: $missing"
    bridge_ok=0 processes_ok=0 example_ok=0
  fi

  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}
  if ((bridge_ok)); then
    run "torch_bridge (LocalComm threads)" "$build_dir/torch_bridge"
    run "torch_state_dict_python (PyTorch loads the checkpoint)" \
      "$source_dir/tests/unit/torch/load_state_dict_test.sh" "$build_dir/torch_bridge"
  fi
  if ((processes_ok)); then
    ((${#gloo[@]})) && run "torch_processes_gloo_np4" timeout 180 "$build_dir/tandemrun" \
      --standalone --nproc-per-node 4 "$build_dir/torch_processes"
    ((${#mpi_link[@]})) && run "torch_processes_mpi_np4" env OMPI_ALLOW_RUN_AS_ROOT=1 \
      OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 timeout 180 mpiexec -n 4 --oversubscribe --bind-to none \
      --timeout 150 "$build_dir/torch_processes"
  fi
  if ((example_ok)) && ((${#gloo[@]})); then
    run "example_torch_resnet_gloo_crash_resume" timeout 600 \
      "$source_dir/examples/torch_resnet/crash_resume_test.sh" "$build_dir/tandemrun" \
      "$build_dir/torch_resnet" "$build_dir/tandem-ckpt"
  fi
fi

# The CUDA path: the bridge over NcclComm (device arena, libtorch's stream) and the CUDA example.
nvcc=${NVCC:-/usr/local/cuda/bin/nvcc}
cuda_home=$(cd "$(dirname "$nvcc")/.." 2>/dev/null && pwd)
if [[ $steps != *cuda* ]]; then
  :
elif [[ ! -e $torch_dir/lib/libc10_cuda.so ]]; then
  record SKIP "CUDA steps: this libtorch has no CUDA (no libc10_cuda.so)"
elif [[ ! -x $nvcc ]]; then
  record SKIP "CUDA steps: no nvcc at $nvcc (set NVCC)"
else
  # shellcheck disable=SC2054  # the commas belong to nvcc's flags
  cuda_flags=(-forward-unknown-to-host-compiler "-D_GLIBCXX_USE_CXX11_ABI=$abi" -std=c++20
    "--generate-code=arch=compute_${CUDA_ARCH:-90},code=[sm_${CUDA_ARCH:-90}]"
    -Werror=all-warnings -Xcompiler=-Wall,-Wextra -I"$source_dir/include"
    "-isystem=$cuda_home/include" "-isystem=$torch_dir/include"
    "-isystem=$torch_dir/include/torch/csrc/api/include")
  # shellcheck disable=SC2054  # the commas belong to the linker flags
  cuda_libs=(-L"$torch_dir/lib" -Wl,--no-as-needed -ltorch_cuda -lc10_cuda -ltorch_cpu -lc10
    -Wl,--as-needed -Wl,-rpath,"$torch_dir/lib" -Wl,--allow-shlib-undefined
    -L"$cuda_home/lib64" -Wl,-rpath,"$cuda_home/lib64" -lnccl -lcudart -lpthread)
  nvcc_compile() {  # nvcc_compile NAME SOURCE FLAGS...
    local name=$1 source=$2
    shift 2
    echo "-- compiling $source with nvcc"
    if "$nvcc" "${cuda_flags[@]}" "$@" -x cu -c "$source_dir/$source" -o "$build_dir/$name.o" \
      >"$build_dir/$name.log" 2>&1; then
      record PASS "nvcc compile $source against libtorch $version"
    else
      grep -E 'error' "$build_dir/$name.log" | head -20
      record FAIL "nvcc compile $source (log: $build_dir/$name.log)"
      return 1
    fi
  }
  cuda_link() {  # cuda_link NAME OBJECTS_AND_LIBS...: fails when it cannot run here either
    local name=$1 missing
    shift
    if $cxx -o "$build_dir/$name" "$@" >"$build_dir/$name.link.log" 2>&1; then
      record PASS "link $name against libtorch_cuda"
      missing=$(ldd "$build_dir/$name" | awk '/not found/{print $1}' | sort -u | tr '\n' ' ')
      if [[ -n $missing ]]; then
        record SKIP "running $name: libraries not found here: $missing"
        return 1
      fi
    else
      grep -E 'undefined|error' "$build_dir/$name.link.log" | head -20
      record FAIL "link $name (log: $build_dir/$name.link.log)"
      return 1
    fi
  }
  if nvcc_compile torch_bridge_cuda tests/unit/torch/ddp_cuda_test.cu -I"$source_dir/tests" &&
    cuda_link torch_bridge_cuda "$build_dir/torch_bridge_cuda.o" "${cuda_libs[@]}"; then
    run "torch_bridge_cuda (NcclComm, device arena)" "$build_dir/torch_bridge_cuda"
  fi
  if ((${#zlib[@]})) &&
    nvcc_compile torch_resnet_cuda examples/torch_resnet/torch_resnet_cuda.cu \
      -I"$source_dir/examples" &&
    cuda_link torch_resnet_cuda "$build_dir/torch_resnet_cuda.o" "${zlib[@]}" "${cuda_libs[@]}"; then
    run "example_torch_resnet_cuda (200 steps, one GPU)" "$build_dir/torch_resnet_cuda" \
      --epochs 1 --max-steps 200 --min-accuracy 70
  fi
fi

echo
echo "libtorch ${version:-unknown} ($torch_dir), _GLIBCXX_USE_CXX11_ABI=$abi:"
printf '  %s\n' "${results[@]}"
exit "$failed"
