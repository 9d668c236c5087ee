#!/usr/bin/env bash
# Create (or update) the virtual environment .venv at the repository root and install ds_recycle into it.
#
#   bash launch/setup_venv.sh            # CPU machine: torch 2.13.0 CPU build; GPU machine: a CUDA torch
#   PYTHON=python3.11 bash launch/setup_venv.sh
#
# torch is installed first and explicitly, so that deepspeed's requirement (torch>=2.0) is already met
# and pip never picks a multi-GB CUDA build on a CPU machine. On a machine with an NVIDIA driver, an
# already installed torch is kept as it is (TORCH_SPEC overrides what is installed when none is).
set -euo pipefail

PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV="$ROOT/.venv"
if command -v nvidia-smi >/dev/null 2>&1; then
  TORCH_SPEC=${TORCH_SPEC:-torch}
else
  TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing $TORCH_SPEC"
  "${PIP[@]}" "$TORCH_SPEC"
fi
echo "setup: installing ds_recycle and its dependencies"
"${PIP[@]}" -e "$ROOT[test]"
"$VENV/bin/python" -c "import torch, deepspeed; print(f'setup: torch {torch.__version__}, deepspeed {deepspeed.__version__}')"
# Byte-compile the package once: where PYTHONDONTWRITEBYTECODE is set, every worker process
# would otherwise compile ds_recycle's sources again at each start.
"$VENV/bin/python" -m compileall -q "$ROOT/ds_recycle" "$ROOT/launch" >/dev/null
