#!/usr/bin/env bash
# tandemrun --elastic with shell workers (3 per launch): a worker ended by a signal is lost and the
# launch succeeds when the others exit 0; a stopped one is ended once the others have finished; a
# worker that exits non-zero still fails the launch, and so does losing every worker. The order in
# which the workers end does not matter to any case.
#   tandemrun_elastic_test.sh TANDEMRUN
set -u
tandemrun=$1
failed=0

# expect NAME EXIT_CODE TEXT SCRIPT: runs SCRIPT as each worker ($RANK set) under
# tandemrun --standalone --elastic; the launcher must exit EXIT_CODE and say TEXT on stderr.
expect() {
  local name=$1 want=$2 text=$3 script=$4 err code
  err=$(timeout 120 "$tandemrun" --standalone --elastic --nproc-per-node 3 /bin/sh -c "$script" \
        2>&1 >/dev/null)
  code=$?
  if [[ $code -ne $want ]] || ! grep -qF -- "$text" <<<"$err"; then
    echo "FAILED: $name: exit $code (want $want), stderr:"
    sed 's/^/    /' <<<"$err"
    failed=1
  else
    echo "passed: $name"
  fi
}

expect "a killed worker is lost, the others go on" 0 \
  "tandemrun: rank 1 was lost (signal SIGKILL (9)); the others go on (--elastic)" \
  'if [ "$RANK" = 1 ]; then kill -KILL $$; fi; exit 0'
expect "a stopped worker is ended once the others have finished" 0 \
  "tandemrun: rank 2 is stopped and the others have finished: ending it (--elastic)" \
  'if [ "$RANK" = 2 ]; then kill -STOP $$; fi; exit 0'
expect "a worker that exits non-zero fails the launch" 1 "exitcode  : 3" \
  'if [ "$RANK" = 0 ]; then exit 3; fi; exit 0'
expect "losing every worker fails the launch" 1 "Root Cause" 'kill -KILL $$'

if [[ $failed -ne 0 ]]; then exit 1; fi
echo "PASSED: tandemrun --elastic"
