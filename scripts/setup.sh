#!/usr/bin/env bash
# Installs everything a fresh Debian 12 machine needs to build and test tandem.
# Usage: scripts/setup.sh   (as root, or with sudo available)
set -euo pipefail

packages=(
  build-essential cmake ninja-build git pkg-config
  clang-format
  doctest-dev
  libcli11-dev          # tandemrun's command line
  iproute2 procps       # multi-node launcher tests (network namespaces), process inspection
  libgloo-dev           # the Gloo backend
  libopenmpi-dev openmpi-bin   # the MPI backend
  python3 python3-torch # benchmark peer (torch.distributed) and golden data; Debian's torch 1.13
)

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -q
"${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${packages[@]}"
