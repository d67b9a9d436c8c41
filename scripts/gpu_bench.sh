#!/usr/bin/env bash
# MFU of a ~0.9B-parameter Llama-style model (configs/bench/llama_1b_gpu.py) on one H100/H200:
# bf16 compute, cuDNN attention, scanned layers; MFU against the 989 TFLOP/s dense bf16 peak
# (target >= 55%) and against a bf16 matmul measured in the same run. Prints a table, then one JSON
# line; exits non-zero if a self-check fails (jax sees no GPU, config invalid, nothing fits in
# memory, loss not finite). Python side: benchmarks/gpu_mfu.py.
#
# The GPU machine has jax 0.11.2 on Python 3.12 but no ml_collections or grain and no internet.
# Before the run, on a machine with internet, download the missing wheels into .whl/ (git-ignored):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl ml_collections grain array_record portpicker
#
# (ml_collections and portpicker are pure Python py3-none-any wheels; grain and array_record are
# binary cp312 wheels; absl-py, PyYAML, etils, cloudpickle, protobuf and numpy are already there.)
# Carry .whl with the working tree (the device tool's carry: [".whl"]); where ml_collections or grain
# is missing this script installs them with `pip install --no-index --no-deps --target /tmp/site` and
# puts /tmp/site and the repository on PYTHONPATH (checked here on Python 3.12 + JAX 0.11.2, CPU). Usage:
#
#   bash scripts/gpu_bench.sh [--steps 10] [--attempts 16:none,16:dots,8:dots] [--json OUT]
#   bash scripts/gpu_bench.sh --smoke          # anywhere (CPU): tiny override, checks the pipeline
#
# PYTHON=... chooses the interpreter (default python3). XLA_PYTHON_CLIENT_MEM_FRACTION defaults to
# 0.94 here so the largest batch can use most of the GPU's memory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The carried wheels are a fallback: installed only where ml_collections or grain is missing (a
# cp312 wheel would not even install on another Python).
if ! "$PY" -c "import ml_collections, grain" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
  rm -rf /tmp/site
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}
"$PY" - <<'PYEOF' || { echo "self-check failed: cannot import ml_collections / tformer_jax (see the header)"; exit 1; }
import ml_collections, tformer_jax.config  # noqa: F401
PYEOF
exec "$PY" benchmarks/gpu_mfu.py "$@"
