#!/usr/bin/env bash
# Installs everything a fresh Debian 12 machine needs to build, test and package tandem.
# Usage: scripts/setup.sh   (as root, or as a user who may sudo: it asks for sudo only for apt)
# Safe to run again: what is already installed is left alone (no apt-get at all when every
# package is there, no pip when a Conan 2 answers).
set -euo pipefail

packages=(
  build-essential cmake ninja-build git pkg-config
  clang-format
  clang libclang-rt-14-dev   # tests/fuzz/run.sh: libFuzzer (libclang_rt.fuzzer) with ASan+UBSan
  doctest-dev
  libcli11-dev          # tandemrun's command line
  iproute2 procps       # multi-node launcher tests (network namespaces), process inspection
  libgloo-dev           # the Gloo backend
  libopenmpi-dev openmpi-bin   # the MPI backend
  python3 python3-torch # benchmark peer (torch.distributed) and golden data; Debian's torch 1.13
  libtorch-dev          # the libtorch bridge (tandem::torch, CMake component torch): libtorch 1.13.1
  python3-venv          # a private environment for Conan where python3's own is not writable
  zlib1g-dev            # gzip'd IDX files (data/)
  dataset-fashion-mnist # the examples' real data set, under /usr/share/datasets/fashion-mnist
  libopenblas-dev       # the examples' and benchmarks' matrix products
  nlohmann-json3-dev    # JSON (checkpoint metadata, reports)
  doxygen               # the API reference (the docs target and its test)
  python3-matplotlib    # bench/fashion_mnist's plot (Debian's Python, beside its torch)
)
conan_requirement='conan>=2,<3'
# What the interop tests read tandem's files with (tests/unit/io: label interop).
python_packages=(safetensors numpy tensorboard)
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

# --- Debian packages: through sudo only when we are not root -------------------------------------
as_root=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "setup.sh: not root and no sudo: run it as root, or install sudo" >&2
    exit 1
  fi
  as_root=(sudo)
fi

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "${package}" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("${package}")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup.sh: installing ${missing[*]}"
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${as_root[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup.sh: all ${#packages[@]} Debian packages are installed"
fi

# --- Python packages for the interop tests, for the python3 first on PATH (CMake's Python) ------
# Only where pip may install into that Python: its site-packages is ours to write and it is not
# "externally managed" as Debian's own Python is (a pyenv or a virtual environment is fine);
# elsewhere the interop tests say they are skipped.
python=$(command -v python3)
pip_allowed() {
  "${python}" -m pip --version >/dev/null 2>&1 && "${python}" -c '
import os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) and sys.prefix == sys.base_prefix
sys.exit(0 if os.access(sysconfig.get_paths()["purelib"], os.W_OK) and not managed else 1)'
}
if ! "${python}" -c "import safetensors, numpy, tensorboard" >/dev/null 2>&1; then
  if pip_allowed; then
    "${python}" -m pip install -q "${python_packages[@]}"
  else
    echo "setup.sh: ${python} takes no pip packages: the interop tests will say they are skipped" >&2
  fi
fi

# --- One Python with both torch and safetensors: tandem-python --------------------------------
# PyTorch loads the libtorch bridge's checkpoints (docs/libtorch.md; tests/unit/torch's
# torch_state_dict_python). Debian's torch lives in /usr/bin/python3, which is "externally managed"
# and Debian 12 has no python3-safetensors; so a virtual environment over that Python that sees
# its packages (torch, numpy) gets safetensors from PyPI, and `tandem-python` on PATH runs it.
if [ "$(id -u)" -eq 0 ]; then
  torch_venv=/opt/tandem/torch-python bindir=/usr/local/bin
else
  torch_venv=${XDG_DATA_HOME:-${HOME}/.local/share}/tandem/torch-python bindir=${HOME}/.local/bin
fi
has_modules() {  # has_modules PYTHON MODULE...: found without importing them (torch takes seconds)
  local python=$1
  shift
  "${python}" -c '
import importlib.util, sys
sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)' "$@" 2>/dev/null
}
if ! has_modules "${torch_venv}/bin/python" torch safetensors; then
  [ -x "${torch_venv}/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "${torch_venv}"
  "${torch_venv}/bin/python" -m pip install -q safetensors
fi
mkdir -p "${bindir}"
# A script, not a link: Python finds its virtual environment from the path it was started by.
tandem_python="#!/bin/sh
exec '${torch_venv}/bin/python' \"\$@\""
if [ -L "${bindir}/tandem-python" ] ||
  [ "$(cat "${bindir}/tandem-python" 2>/dev/null)" != "${tandem_python}" ]; then
  rm -f "${bindir}/tandem-python"
  printf '%s\n' "${tandem_python}" >"${bindir}/tandem-python"
  chmod 755 "${bindir}/tandem-python"
fi
if ! has_modules "${bindir}/tandem-python" torch safetensors; then
  echo "setup.sh: ${bindir}/tandem-python lacks torch or safetensors" >&2
  exit 1
fi
echo "setup.sh: tandem-python (${torch_venv}) has torch and safetensors"
case ":${PATH}:" in
  *":${bindir}:"*) ;;
  *) echo "setup.sh: tandem-python is ${bindir}/tandem-python; add ${bindir} to PATH" >&2 ;;
esac

# --- Conan 2, from PyPI, for whoever runs this (the user, not root, when sudo was used) ----------
conan_is_2() { command -v conan >/dev/null 2>&1 && conan --version 2>/dev/null | grep -q " 2\."; }
if conan_is_2; then
  echo "setup.sh: $(conan --version) at $(command -v conan)"
  exit 0
fi

# The python3 first on PATH, when its site-packages is ours to write and pip may install there (a
# pyenv or a virtual environment); otherwise a private virtual environment with a link on PATH
# (Debian's own Python is "externally managed" and refuses pip).
if pip_allowed; then
  "${python}" -m pip install -q "${conan_requirement}"
  command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
else
  if [ "$(id -u)" -eq 0 ]; then
    venv=/opt/tandem/conan-venv bindir=/usr/local/bin
  else
    venv=${XDG_DATA_HOME:-${HOME}/.local/share}/tandem/conan-venv bindir=${HOME}/.local/bin
  fi
  [ -x "${venv}/bin/python" ] || /usr/bin/python3 -m venv "${venv}"
  "${venv}/bin/python" -m pip install -q "${conan_requirement}"
  mkdir -p "${bindir}"
  ln -sf "${venv}/bin/conan" "${bindir}/conan"
  case ":${PATH}:" in
    *":${bindir}:"*) ;;
    *) echo "setup.sh: Conan is ${bindir}/conan; add ${bindir} to PATH" >&2 ;;
  esac
  export PATH="${bindir}:${PATH}"
fi
hash -r
if ! conan_is_2; then
  echo "setup.sh: Conan 2 was installed but 'conan' does not answer on PATH" >&2
  exit 1
fi
echo "setup.sh: $(conan --version) at $(command -v conan)"
