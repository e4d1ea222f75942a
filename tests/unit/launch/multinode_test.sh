#!/bin/bash
# Two "nodes" as two network namespaces joined by a veth pair (10.77.0.1 and 10.77.0.2); one
# tandemrun per namespace runs 2 workers that meet through a TcpStore on node 0.
# Usage: multinode_test.sh TANDEMRUN WORKER. Needs root and `ip netns`; otherwise exit 77.
source "$(dirname "$0")/../../support/two_nodes.sh"
tandemrun=$1
worker=$2

two_nodes_up tandem_mn 10.77.0
two_node_job 60 29611 "$tandemrun" "$worker" store
cat "$out"/node0.out "$out"/node1.out
for rank in 0 1 2 3; do
  expect_line "$rank" "rank $rank of 4 on node $((rank / 2)) met all ranks" \
    "did not report from node $((rank / 2))"
done
two_nodes_end "2 nodes x 2 workers met across the veth pair"
