#!/usr/bin/env bash
# Builds the libFuzzer binaries of tests/fuzz with clang (build/fuzz) and runs every target
# (each tests/fuzz/<name>_fuzz.cpp) for at least a million inputs, one target at a time, seeded
# from tests/fuzz/corpus/<name>/ and the crashes kept in tests/fuzz/crashes/<name>/; then writes
# bench/results/fuzz.md. Not run in CI (minutes per target); CI replays the corpus and crashes.
# Usage: tests/fuzz/run.sh [name...]        (default: every target)
# Environment: FUZZ_RUNS (inputs per target, default 1000000), FUZZ_JOBS (parallel workers per
# target, default 1, at most 2 here), FUZZ_BUILD_DIR (default build/fuzz), CXX (default clang++),
# FUZZ_RESULTS (default bench/results/fuzz.md).
# Per target, optional: a "// fuzz-max-len: N" line in its source (default 4096) and a libFuzzer
# dictionary tests/fuzz/<name>.dict.
# A crash stops that target: the input is minimised into tests/fuzz/crashes/<name>/ (so the
# replay test fails until the bug is fixed), the table says so, and the script exits 1 at the end.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${FUZZ_BUILD_DIR:-${root}/build/fuzz}
runs=${FUZZ_RUNS:-1000000}
jobs=${FUZZ_JOBS:-1}
results=${FUZZ_RESULTS:-${root}/bench/results/fuzz.md}
cxx=${CXX:-clang++}
here=${root}/tests/fuzz

if [ $# -gt 0 ]; then
  names=("$@")
else
  names=()
  for source in "${here}"/*_fuzz.cpp; do
    names+=("$(basename "${source}" _fuzz.cpp)")
  done
fi

cmake -S "${root}" -B "${build}" -G Ninja -DCMAKE_CXX_COMPILER="${cxx}" -DCMAKE_BUILD_TYPE= \
  -DCMAKE_CXX_FLAGS="-O1 -g -fno-omit-frame-pointer" -DTANDEM_BUILD_TESTS=ON \
  -DTANDEM_BUILD_TOOLS=ON -DTANDEM_BUILD_FUZZERS=ON -DTANDEM_WITH_CUDA=OFF \
  -DTANDEM_WITH_GLOO=OFF -DTANDEM_WITH_MPI=OFF >"${build}.configure.log" 2>&1 ||
  { cat "${build}.configure.log"; exit 1; }
targets=()
for name in "${names[@]}"; do targets+=("${name}_fuzzer"); done
cmake --build "${build}" --target "${targets[@]}" -j "${jobs}"

commit=$(git -C "${root}" rev-parse --short HEAD)
git -C "${root}" diff --quiet HEAD -- include tests/fuzz || commit="${commit}+"
mkdir -p "${build}/logs" "${build}/rows" "$(dirname "${results}")"
failed=0
for name in "${names[@]}"; do
  source=${here}/${name}_fuzz.cpp
  max_len=$(sed -n 's|^// fuzz-max-len: *\([0-9]*\).*|\1|p' "${source}" | head -1)
  max_len=${max_len:-4096}
  work=${build}/corpus/${name}
  artifacts=${build}/artifacts/${name}
  mkdir -p "${work}" "${artifacts}"
  seeds=("${here}/corpus/${name}")
  [ -d "${here}/crashes/${name}" ] && seeds+=("${here}/crashes/${name}")
  options=(-runs="${runs}" -max_len="${max_len}" -timeout=10 -rss_limit_mb=2048
    -print_final_stats=1 -artifact_prefix="${artifacts}/")
  [ -f "${here}/${name}.dict" ] && options+=(-dict="${here}/${name}.dict")
  # With workers, each runs its share of the inputs (libFuzzer's -jobs, one log each).
  if [ "${jobs}" -gt 1 ]; then
    options=("${options[@]/-runs=*/-runs=$(((runs + jobs - 1) / jobs))}" -jobs="${jobs}"
      -workers="${jobs}")
  fi
  log=${build}/logs/${name}.log
  echo "run.sh: ${name}: ${runs} inputs, max_len ${max_len}"
  start=$(date +%s)
  status=0
  rm -f "${build}"/logs/fuzz-*.log
  (cd "${build}/logs" && "${build}/tests/fuzz/${name}_fuzzer" "${options[@]}" "${work}" \
    "${seeds[@]}") >"${log}" 2>&1 || status=$?
  seconds=$(($(date +%s) - start))
  # (With workers, libFuzzer copies each worker's log into its own output as the worker ends.)
  executed=$(grep -h '^stat::number_of_executed_units' "${log}" | awk '{s += $2} END {print s + 0}')
  speed=$(grep -h '^stat::average_exec_per_sec' "${log}" | awk '{s += $2} END {print s + 0}')
  rss=$(grep -h '^stat::peak_rss_mb' "${log}" | awk '{if ($2 > m) m = $2} END {print m + 0}')
  last=$(grep -h -E '^#[0-9]+' "${log}" | tail -1)
  cov=$(echo "${last}" | sed -n 's/.* cov: \([0-9]*\).*/\1/p')
  features=$(echo "${last}" | sed -n 's/.* ft: \([0-9]*\).*/\1/p')
  corpus=$(echo "${last}" | sed -n 's|.* corp: \([0-9]*\)/.*|\1|p')
  crashes=none
  for artifact in "${artifacts}"/crash-* "${artifacts}"/leak-* "${artifacts}"/timeout-* \
    "${artifacts}"/oom-*; do
    [ -f "${artifact}" ] || continue
    failed=1
    kept=${here}/crashes/${name}/$(basename "${artifact}")
    mkdir -p "$(dirname "${kept}")"
    "${build}/tests/fuzz/${name}_fuzzer" -minimize_crash=1 -runs=20000 -max_len="${max_len}" \
      -exact_artifact_path="${kept}" "${artifact}" >"${log}.minimise" 2>&1 ||
      cp "${artifact}" "${kept}"
    [ -f "${kept}" ] || cp "${artifact}" "${kept}"
    crashes="$( [ "${crashes}" = none ] || echo "${crashes}, ")tests/fuzz/crashes/${name}/$(basename "${kept}")"
    rm -f "${artifact}"
  done
  if [ "${status}" -ne 0 ] && [ "${crashes}" = none ]; then
    crashes="the fuzzer exited ${status} (see ${log})"
    failed=1
  fi
  # One row per target, kept between runs of this build: a rerun of one target keeps the others.
  echo "| ${name} | ${executed} | ${seconds} s | ${jobs} | ${speed} | ${cov:-?} | ${features:-?} | ${corpus:-?} | ${max_len} | ${rss} MB | ${crashes} | $(date -u '+%Y-%m-%d %H:%M') | ${commit} |" \
    >"${build}/rows/${name}.md"
  echo "run.sh: ${name}: ${executed} inputs in ${seconds} s, cov ${cov:-?}, crashes: ${crashes}"
done

{
  echo "# Fuzzing: libFuzzer over tandem's parsers"
  echo
  echo "Written by \`tests/fuzz/run.sh\` on $(date -u '+%Y-%m-%d %H:%M UTC'); each row says when and at"
  echo "which commit its target ran (\`+\`: with uncommitted changes to include/ or tests/fuzz/)."
  echo "Compiler: $("${cxx}" --version | head -1), \`-fsanitize=fuzzer,address,undefined\`, -O1."
  echo "Machine: $(nproc) CPUs shared with other work; one target at a time, with the workers shown."
  echo "Seeds: tests/fuzz/corpus/<target>/ and tests/fuzz/crashes/<target>/ (replayed in CI by"
  echo "the \`fuzz_replay_<target>\` tests, label \`fuzz\`)."
  echo
  echo "| target | inputs run | time | workers | exec/s | coverage (edges) | features | corpus | max_len | peak RSS | crashes | run (UTC) | commit |"
  echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"
  for source in "${here}"/*_fuzz.cpp; do
    name=$(basename "${source}" _fuzz.cpp)
    if [ -f "${build}/rows/${name}.md" ]; then
      cat "${build}/rows/${name}.md"
    else
      echo "| ${name} | not run yet | | | | | | | | | | | |"
    fi
  done
  echo
  echo "Coverage is libFuzzer's count of instrumented edges reached (\`cov:\`) over the whole"
  echo "binary (tandem's headers, nlohmann-json and the standard library included); features adds"
  echo "edge counts and value profiles. exec/s is libFuzzer's average over the run, summed over"
  echo "the workers."
  if [ -f "${here}/crashes/README.md" ]; then
    echo
    sed -n '/^## /,$p' "${here}/crashes/README.md"
  fi
} >"${results}"
echo "run.sh: wrote ${results}"
exit "${failed}"
