#!/bin/bash
# HierarchicalComm<ShmComm, GlooComm> across two real "nodes": two network namespaces joined by a
# veth pair (10.78.0.1 and 10.78.0.2), one tandemrun per namespace with 2 ranks each, meeting
# through a TcpStore on node 0. Each rank runs hierarchical_conformance --real-nodes (nodes from
# tandemrun's GROUP_RANK): ShmComm within a namespace, Gloo over the veth pair between the leaders;
# the cases: the nodes, all_reduce's bits (node sums, then across nodes), DDP steps against one
# rank's, every collective of the suite, and a rank that leaves at either level.
# Usage: multinode_test.sh TANDEMRUN HIERARCHICAL_CONFORMANCE. Needs root and `ip netns`;
# otherwise exit 77 (skipped).
source "$(dirname "$0")/../../support/two_nodes.sh"
tandemrun=$1
program=$2

two_nodes_up tandem_hier 10.78.0
two_node_job 150 29623 "$tandemrun" "$program" --real-nodes
[ "$status" = 0 ] && grep -h "test cases:" "$out"/node0.out "$out"/node1.out
[ "$status" = 0 ] || cat "$out"/node0.out "$out"/node1.out
for rank in 0 1 2 3; do
  node=$((rank / 2))
  expect_line "$rank" "rank $rank of 4 on node $node of 2: hierarchical communicator made" \
    "did not report from node $node"
  expect_line "$rank" "\[doctest\] Status: SUCCESS!" "did not pass all its cases"
done
two_nodes_end "HierarchicalComm over 2 nodes x 2 ranks across the veth pair"
