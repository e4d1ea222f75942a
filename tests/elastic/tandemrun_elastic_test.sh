#!/usr/bin/env bash
# tandemrun --elastic with shell workers (3 per launch): a worker ended by a signal is lost and the
# launch succeeds when the others exit 0; a stopped one is ended once the others have finished; a
# worker that exits non-zero still fails the launch, and so does losing every worker; with
# --max-restarts a lost worker is replaced (TANDEM_ELASTIC_JOIN=1) while restarts are left and no
# worker has finished. The order in
# which the workers end does not matter to any case.
#   tandemrun_elastic_test.sh TANDEMRUN
set -u
tandemrun=$1
failed=0

# expect NAME EXIT_CODE TEXT SCRIPT [FLAGS...]: runs SCRIPT as each worker ($RANK set) under
# tandemrun --standalone --elastic FLAGS; the launcher must exit EXIT_CODE and say TEXT on stderr.
expect() {
  local name=$1 want=$2 text=$3 script=$4 err code
  shift 4
  err=$(timeout 120 "$tandemrun" --standalone --elastic "$@" --nproc-per-node 3 \
        /bin/sh -c "$script" 2>&1 >/dev/null)
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

# Replacements (--max-restarts): a lost worker is started again, alone, with TANDEM_ELASTIC_JOIN=1
# (the replacement checks it, and exits 0); once the restarts are spent a loss is only a loss;
# and once a worker has finished (the run ends), a lost one is not replaced.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The others end only once the replacement has started (a finished worker ends replacing).
expect "a lost worker is replaced" 0 \
  "tandemrun: rank 1 was lost (signal SIGKILL (9)); the others go on and a replacement joins them" \
  "if [ \"\$RANK\" = 1 ]; then
     if [ \"\$TANDEM_ELASTIC_JOIN\" = 1 ]; then touch $work/replaced; exit 0; fi
     kill -KILL \$\$
   fi
   [ -z \"\$TANDEM_ELASTIC_JOIN\" ] || exit 5
   while [ ! -f $work/replaced ]; do sleep 0.05; done; exit 0" --max-restarts 1
expect "a replacement lost again with no restart left is only lost" 0 \
  "tandemrun: rank 1 was lost (signal SIGKILL (9)); the others go on (--elastic)" \
  "if [ \"\$RANK\" = 1 ]; then
     if [ \"\$TANDEM_ELASTIC_JOIN\" = 1 ]; then touch $work/replaced2; fi
     kill -KILL \$\$
   fi
   while [ ! -f $work/replaced2 ]; do sleep 0.05; done; exit 0" --max-restarts 1
expect "no replacement once a worker has finished" 0 \
  "tandemrun: rank 2 was lost (signal SIGKILL (9)); the others go on (--elastic)" \
  "if [ \"\$RANK\" = 0 ]; then echo \$\$ > $work/pid.tmp; mv $work/pid.tmp $work/pid; exit 0; fi
   if [ \"\$RANK\" = 2 ]; then
     while [ ! -f $work/pid ]; do sleep 0.05; done
     while kill -0 \$(cat $work/pid) 2>/dev/null; do sleep 0.05; done
     kill -KILL \$\$
   fi; exit 0" --max-restarts 1

# torchrun's elastic --nnodes MIN:MAX: with --elastic (and no --rdzv-endpoint) tandemrun runs MIN
# nodes (here one: every worker sees WORLD_SIZE=3) and says so; without --elastic it stays
# refused.
expect "--nnodes 1:2 with --elastic runs one node" 0 \
  "tandemrun: --nnodes 1:2: running 1 node(s)" \
  '[ "$WORLD_SIZE" = 3 ] && [ "$GROUP_WORLD_SIZE" = 1 ] || exit 4; exit 0' --nnodes 1:2
err=$(timeout 120 "$tandemrun" --standalone --nnodes 1:2 --nproc-per-node 1 /bin/true 2>&1)
if [[ $? -ne 2 ]] || ! grep -qF "'1:2' is an elastic size" <<<"$err"; then
  echo "FAILED: --nnodes 1:2 without --elastic is refused: $err"
  failed=1
else
  echo "passed: --nnodes 1:2 without --elastic is refused"
fi

# --rdzv-endpoint (where the launchers of a job that grows meet; tested end to end by
# elastic_grow_nodes) needs --elastic and MIN < MAX.
err=$(timeout 120 "$tandemrun" --standalone --nnodes 1 --rdzv-endpoint 127.0.0.1:1 /bin/true 2>&1)
if [[ $? -ne 2 ]] || ! grep -qF "it needs --elastic and --nnodes MIN:MAX with MIN < MAX" <<<"$err"
then
  echo "FAILED: --rdzv-endpoint without an elastic size is refused: $err"
  failed=1
else
  echo "passed: --rdzv-endpoint without an elastic size is refused"
fi

if [[ $failed -ne 0 ]]; then exit 1; fi
echo "PASSED: tandemrun --elastic"
