#!/usr/bin/env bash
# bench/nccl/run_nccl.sh - runs bench_nccl (NcclComm::all_reduce vs raw ncclAllReduce, world size
# 1, 4 B to 256 MiB) and records the run in bench/results/nccl-<date>.md: device, driver, NCCL,
# date, command and the RESULT lines as a table.
#   bench/nccl/run_nccl.sh [BUILD_DIR] [--out FILE] [-- extra bench_nccl flags]
#   (BUILD_DIR defaults to build/release; it needs TANDEM_BUILD_BENCH and CUDA with NCCL)
# Without a GPU bench_nccl exits 77; so does this script, writing nothing.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=build/release
out=$root/bench/results/nccl-$(date -u +%Y-%m-%d).md
command_line="bench/nccl/run_nccl.sh $*"
extra=()
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h | --help) sed -n '2,8p' "$0"; exit 0 ;;
    -*) echo "unknown option $1" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
case $build in /*) ;; *) build=$root/$build ;; esac
program=$build/bench/nccl/bench_nccl
[[ -x $program ]] || { echo "no $program: build with -DTANDEM_BUILD_BENCH=ON and CUDA" >&2; exit 2; }

tmp=$(mktemp /tmp/tandem-bench-nccl.XXXXXX)
trap 'rm -f "$tmp"' EXIT
status=0
"$program" "${extra[@]}" | tee "$tmp" || status=$?
if ((status == 77)); then exit 77; fi
((status == 0)) || { echo "bench_nccl failed with exit code $status" >&2; exit "$status"; }

device=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
{
  echo "# NcclComm::all_reduce vs raw ncclAllReduce (world size 1)"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- device, driver: ${device:-unknown (nvidia-smi missing)}"
  echo "- $(grep '^# device' "$tmp" | sed 's/^# //')"
  echo "- command: \`$command_line\`"
  echo "- time_us: GPU time per call (CUDA events, median of trials); host_us: host time per call"
  echo "  to issue; busbw = algbw * 2(n-1)/n (nccl-tests), 0 at one rank."
  echo
  echo "tandem: sync operations on the caller's stream (the default); handoff:"
  echo "sync_on_caller_stream = false (an event to the communicator's stream and one back)."
  echo
  echo "| size (B) | raw time (us) | tandem time (us) | added (us) | handoff added (us) | raw host (us) | tandem host (us) | added host (us) | handoff added host (us) | tandem algbw (GB/s) |"
  echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
  awk '
    /^RESULT/ {
      delete kv
      for (i = 2; i <= NF; i++) { split($i, p, "="); kv[p[1]] = p[2] }
      s = kv["size_bytes"]
      if (kv["impl"] == "raw_nccl") { rt[s] = kv["time_us"]; rh[s] = kv["host_us"] }
      if (kv["impl"] == "tandem") { tt[s] = kv["time_us"]; th[s] = kv["host_us"]; ta[s] = kv["algbw_GBps"] }
      if (kv["impl"] == "overhead" && kv["of"] == "tandem") { at[s] = kv["added_time_us"]; ah[s] = kv["added_host_us"] }
      if (kv["impl"] == "overhead" && kv["of"] == "tandem_handoff") {
        printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", s, rt[s], tt[s], at[s],
          kv["added_time_us"], rh[s], th[s], ah[s], kv["added_host_us"], ta[s]
      }
    }' "$tmp"
} >"$out"
echo "wrote $out"
