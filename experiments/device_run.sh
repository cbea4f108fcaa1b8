#!/usr/bin/env bash
# The prepared GPU check (experiments/device_check.py) on a machine whose Python already has JAX
# for CUDA, Flax, optax, orbax and PyTorch, with no network, from a copy of this repository:
#
#   bash experiments/device_run.sh OUTDIR [device_check flags, e.g. --time_budget_s=240]
#
# 1. Installs the wheels in .whl/ (`make device-wheels` here: this package's small pure-Python
#    dependencies such an image may lack) into a temporary folder put first on PYTHONPATH;
#    .whl/flax/ too, but only where Flax's nnx does not import (a Flax older than its JAX:
#    flax <= 0.12.9 with jax 0.11.2).
# 2. Prints the versions, then runs the check: OUTDIR/device_check.json (written after each
#    section), OUTDIR/device_check.md (its Markdown tables, at the end), OUTDIR/device_check.log
#    (everything printed). Exit status: the check's.
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash experiments/device_run.sh OUTDIR [device_check flags]}
shift
py=${PYTHON:-python3}
mkdir -p "$out"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
install() {
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$@"
}
shopt -s nullglob
wheels=(.whl/*.whl)
flax_wheels=(.whl/flax/*.whl)
if ((${#wheels[@]})); then
  install "${wheels[@]}"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c 'from flax import nnx' 2>/dev/null && ((${#flax_wheels[@]})); then
  echo "flax.nnx does not import here: installing ${flax_wheels[*]}"
  install "${flax_wheels[@]}"
fi
"$py" -c 'import sys, jax, flax, numpy
print("python", sys.version.split()[0], "jax", jax.__version__, "flax", flax.__version__,
      "numpy", numpy.__version__)'
PYTHONUNBUFFERED=1 "$py" -m experiments.device_check --output_json="$out/device_check.json" "$@" \
  2>&1 | tee "$out/device_check.log"
