#!/usr/bin/env bash
# Build the wheel directory scripts/gpu_check.sh installs from (on a machine with network access).
#
#   scripts/gpu_wheels.sh [DIR] [PYTHON_VERSION]     e.g. scripts/gpu_wheels.sh gpu-wheels 3.11
#
# DIR gets mtpquant's own wheel and the wheels of every package this checkout's .venv has installed,
# at the same versions, except torch and the NVIDIA CUDA runtime wheels (the GPU machine brings its
# own torch) and the development tools; binary wheels are fetched for manylinux x86_64 and PYTHON_VERSION
# (measured: 63 wheels, 135 MB for Python 3.11; scipy, numpy and pulp, which modelopt needs, are half of it).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-gpu-wheels}
PYV=${2:-$(.venv/bin/python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
mkdir -p "$DIR"
.venv/bin/pip wheel -q --no-deps --wheel-dir "$DIR" .
.venv/bin/pip freeze --exclude-editable \
  | grep -viE '^(torch|nvidia-[a-z0-9-]*-cu[0-9]+|triton|pytest|ruff|mypy|hypothesis|types-|iniconfig|pluggy|mypy-extensions|pathspec|sortedcontainers)[=@ ]' \
  >"$DIR/requirements.txt"
.venv/bin/pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 --python-version "$PYV" --dest "$DIR" -r "$DIR/requirements.txt"
echo "$DIR: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1)"
