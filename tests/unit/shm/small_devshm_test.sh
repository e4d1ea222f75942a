#!/bin/sh
# shm_small_devshm: ShmComm where /dev/shm is small, as Docker's default of 64 MiB. The test makes
# a user and mount namespace (unshare -Urm) with a tmpfs of its own on /dev/shm and runs
# shm_worker's "small" mode under tandemrun there:
#   64 MiB, 8 ranks   the default segment (68 MiB) does not fit: ShmComm must size it to fit;
#   64 MiB, 32 ranks  the send/recv rings alone (32 x 32 x 64 KiB) take 64 MiB: rings shrink too;
#   256 KiB, 8 ranks  not even the smallest segment fits: every rank must fail at the start with
#                     an Error that says what it needs, what is free and what to change.
# Exit 77 (skipped) where this system does not let the test make the namespaces.
#   small_devshm_test.sh TANDEMRUN SHM_WORKER
set -u
tandemrun=$1
worker=$2
if ! unshare -Urm sh -c 'mount -t tmpfs -o size=1m tmpfs /dev/shm' 2>/dev/null; then
  echo "skipped: cannot mount a tmpfs of its own on /dev/shm here (unshare -Urm, then mount)"
  exit 77
fi
out=$(mktemp -d /tmp/tandem-small-devshm-XXXXXX)
trap 'rm -rf "$out"' EXIT
failed=0

# in_small_shm SIZE RANKS LOG: runs the worker's "small" mode on RANKS ranks with SIZE of /dev/shm.
in_small_shm() {
  unshare -Urm sh -c 'mount -t tmpfs -o size="$1" tmpfs /dev/shm && exec "$2" --standalone \
    --nproc-per-node "$3" "$4" small env://' sh "$1" "$tandemrun" "$2" "$worker" > "$3" 2>&1
}

for ranks in 8 32; do
  if in_small_shm 64m "$ranks" "$out/fits$ranks"; then
    echo "ok: $ranks ranks on a 64 MiB /dev/shm"
  else
    echo "FAILED: $ranks ranks on a 64 MiB /dev/shm:"; tail -20 "$out/fits$ranks"; failed=1
  fi
done

if in_small_shm 256k 8 "$out/tiny"; then
  echo "FAILED: 8 ranks started on a 256 KiB /dev/shm"; failed=1
else
  for part in "needs at least" "of /dev/shm" "free" "docker run --shm-size" "GlooComm or MpiComm"; do
    if ! grep -q "$part" "$out/tiny"; then
      echo "FAILED: the error on a 256 KiB /dev/shm does not say '$part':"; tail -20 "$out/tiny"
      failed=1
    fi
  done
  [ $failed = 0 ] && echo "ok: a 256 KiB /dev/shm fails at the start: $(grep -m1 'needs at least' "$out/tiny")"
fi
exit $failed
