# tests/support/two_nodes.sh - two "nodes" on one machine for the multinode tests: two network
# namespaces joined by a veth pair, one tandemrun in each, meeting through a TcpStore on node 0.
# Sourced, not run:
#   source "$(dirname "$0")/../../support/two_nodes.sh"
#   two_nodes_up tandem_mn 10.77.0     # namespaces tandem_mn_node0/1 at 10.77.0.1 and 10.77.0.2
#   two_node_job 60 29611 "$tandemrun" "$worker" store   # 2 ranks a node; sets out, rc0, rc1
#   expect_line 3 "rank 3 of 4 on node 1 met all ranks" "did not report from node 1"
#   two_nodes_end "2 nodes met"        # exits 0 with PASSED where every check passed, else 1
# Needs root and `ip netns`; otherwise the test exits 77 (skipped). The namespaces and the job's
# output folder go when the script exits, also when it dies half-way.
set -u
status=0
out=""

skip() {
  echo "SKIPPED: $*"
  exit 77
}

# two_nodes_up NAME SUBNET: namespaces NAME_node0 and NAME_node1, joined by the veth pair
# NAME_a / NAME_b (interface names have at most 15 characters: keep NAME short), at SUBNET.1 and
# SUBNET.2. What a previous run that died left is deleted first.
two_nodes_up() {
  node_ns=("$1_node0" "$1_node1")
  node_if=("$1_a" "$1_b")
  node_addr=("$2.1" "$2.2")
  [ "$(id -u)" = 0 ] || skip "needs root to create network namespaces"
  command -v ip >/dev/null || skip "no ip command (iproute2)"
  two_nodes_cleanup
  trap two_nodes_cleanup EXIT
  ip netns add "${node_ns[0]}" 2>/dev/null || skip "ip netns add does not work here"
  ip netns add "${node_ns[1]}" || skip "ip netns add does not work here"
  ip link add "${node_if[0]}" netns "${node_ns[0]}" type veth \
    peer name "${node_if[1]}" netns "${node_ns[1]}" || skip "cannot create a veth pair"
  local i
  for i in 0 1; do
    ip -n "${node_ns[i]}" addr add "${node_addr[i]}/24" dev "${node_if[i]}" || exit 1
    ip -n "${node_ns[i]}" link set lo up || exit 1
    ip -n "${node_ns[i]}" link set "${node_if[i]}" up || exit 1
  done
}

two_nodes_cleanup() {
  ip netns del "${node_ns[0]}" 2>/dev/null
  ip netns del "${node_ns[1]}" 2>/dev/null
  [ -n "$out" ] && rm -rf "$out"
  return 0
}

# two_node_job SECONDS PORT TANDEMRUN PROGRAM ARGS...: one tandemrun a namespace, 2 ranks each,
# the store on node 0's address at PORT, both bounded by SECONDS. Node 0 says --node-rank and
# node 1 torchrun's other spelling --node_rank, so a real job uses both. Gloo listens on the
# node's end of the pair (GLOO_SOCKET_IFNAME: this host's name resolves to loopback in a
# namespace). Sets `out` (node0.out, node0.err, node1.out, node1.err in it) and rc0, rc1.
two_node_job() {
  local seconds=$1 port=$2 tandemrun=$3
  shift 3
  out=$(mktemp -d)
  echo "two-node-token" >"$out/token"  # every node shares it: the store refuses others
  local common=(--nnodes 2 --nproc-per-node 2 --master-addr "${node_addr[0]}"
                --master-port "$port" --rdzv-token-file "$out/token" --rdzv-id "two_nodes_$port")
  local flags=(--node-rank --node_rank) pids=() i
  for i in 0 1; do
    timeout "$seconds" ip netns exec "${node_ns[i]}" env GLOO_SOCKET_IFNAME="${node_if[i]}" \
      "$tandemrun" "${common[@]}" "${flags[i]}" "$i" "$@" >"$out/node$i.out" 2>"$out/node$i.err" &
    pids+=($!)
  done
  wait "${pids[0]}"
  rc0=$?
  wait "${pids[1]}"
  rc1=$?
  if [ "$rc0" != 0 ] || [ "$rc1" != 0 ]; then
    echo "FAILED: launcher exit codes $rc0 (node 0) and $rc1 (node 1)"
    cat "$out"/node0.err "$out"/node1.err
    status=1
  fi
}

# expect_line RANK TEXT WHY: rank RANK (on node RANK / 2) printed the line TEXT (a grep pattern),
# else "FAILED: rank RANK WHY" and the test fails.
expect_line() {
  if ! grep -q "^\[rank $1\] $2\$" "$out/node$(($1 / 2)).out"; then
    echo "FAILED: rank $1 $3"
    status=1
  fi
}

# two_nodes_end WHAT: "PASSED: WHAT" and exit 0 where every check passed, else exit 1.
two_nodes_end() {
  [ "$status" = 0 ] || exit 1
  echo "PASSED: $1"
  exit 0
}
