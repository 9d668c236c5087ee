#!/usr/bin/env bash
# Gather, where pip can reach an index, the wheels that a GPU machine without network needs to run ds_recycle
# beside its own torch (CUDA build, NumPy, SciPy, Triton already there): DeepSpeed (published as source only, so
# built into a wheel here) and the packages it needs that such images often lack. Versions are this checkout's
# .venv's, so both machines run the same DeepSpeed and pydantic.
#
#   bash launch/gpu_wheels.sh DIR [PYTHON_VERSION]     # PYTHON_VERSION of the GPU machine, default 3.12
#   python3 benchmarks/gpu_check.py --wheels DIR       # then, on the GPU machine
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${1:?give the folder for the wheels}
PYVER=${2:-3.12}
PIP=("$ROOT/.venv/bin/python" -m pip)
[[ -x $ROOT/.venv/bin/python ]] || { echo "gpu_wheels: no .venv here; run launch/setup_venv.sh first" >&2; exit 2; }
[[ $PYVER =~ ^3\.[0-9]+$ ]] || { echo "gpu_wheels: python version '$PYVER': give it as 3.N, e.g. 3.12" >&2; exit 2; }

version() { "${PIP[@]}" show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
mkdir -p "$OUT"
"${PIP[@]}" wheel -q --no-deps -w "$OUT" "deepspeed==$(version deepspeed)"
pins=()
for pkg in hjson pydantic pydantic_core annotated-types typing-inspection typing_extensions; do
    v=$(version "$pkg")
    [[ -n $v ]] || { echo "gpu_wheels: $pkg is not in .venv; run launch/setup_venv.sh again" >&2; exit 2; }
    pins+=("$pkg==$v")
done
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT" "${pins[@]}"
ls "$OUT"
