#!/bin/bash
# Two "nodes" as two network namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2); one
# tandemrun per namespace runs 2 workers that meet through a TcpStore on node 0.
# Usage: multinode_test.sh TANDEMRUN WORKER. Needs root and `ip netns`; otherwise exit 77.
set -u
tandemrun=$1
worker=$2
ns0=tandem_mn_node0
ns1=tandem_mn_node1

skip() { echo "SKIPPED: $*"; exit 77; }
cleanup() {
  ip netns del "$ns0" 2>/dev/null
  ip netns del "$ns1" 2>/dev/null
}

[ "$(id -u)" = 0 ] || skip "needs root to create network namespaces"
command -v ip >/dev/null || skip "no ip command (iproute2)"
cleanup  # what a previous run that died may have left
trap cleanup EXIT
ip netns add "$ns0" 2>/dev/null || skip "ip netns add does not work here"
ip netns add "$ns1" || skip "ip netns add does not work here"
ip link add tandem_mn_a netns "$ns0" type veth peer name tandem_mn_b netns "$ns1" ||
  skip "cannot create a veth pair"
ip -n "$ns0" addr add 10.77.0.1/24 dev tandem_mn_a || exit 1
ip -n "$ns1" addr add 10.77.0.2/24 dev tandem_mn_b || exit 1
for ns in "$ns0" "$ns1"; do
  ip -n "$ns" link set lo up || exit 1
done
ip -n "$ns0" link set tandem_mn_a up || exit 1
ip -n "$ns1" link set tandem_mn_b up || exit 1

out=$(mktemp -d)
echo "multinode-token" >"$out/token"  # every node shares it: the store refuses others
common=(--nnodes 2 --nproc-per-node 2 --master-addr 10.77.0.1 --master-port 29611
        --rdzv-token-file "$out/token"
        --rdzv-id multinode)
timeout 60 ip netns exec "$ns0" "$tandemrun" "${common[@]}" --node-rank 0 "$worker" store \
  >"$out/node0.out" 2>"$out/node0.err" &
pid0=$!
timeout 60 ip netns exec "$ns1" "$tandemrun" "${common[@]}" --node_rank 1 "$worker" store \
  >"$out/node1.out" 2>"$out/node1.err" &
pid1=$!
wait "$pid0"; rc0=$?
wait "$pid1"; rc1=$?
cat "$out"/node0.out "$out"/node1.out
status=0
if [ "$rc0" != 0 ] || [ "$rc1" != 0 ]; then
  echo "FAILED: launcher exit codes $rc0 (node 0) and $rc1 (node 1)"
  cat "$out"/node0.err "$out"/node1.err
  status=1
fi
for rank in 0 1 2 3; do
  node=$((rank / 2))
  if ! grep -q "^\[rank $rank\] rank $rank of 4 on node $node met all ranks$" "$out/node$node.out"; then
    echo "FAILED: rank $rank did not report from node $node"
    status=1
  fi
done
rm -rf "$out"
[ "$status" = 0 ] && echo "PASSED: 2 nodes x 2 workers met across the veth pair"
exit "$status"
