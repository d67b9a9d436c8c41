#!/usr/bin/env bash
# The one-command GPU check of tformer_jax on one H100/H200: training MFU (a), the PyTorch peer
# eager / torch.compile (b), generation vs transformers generate (c), attention speed and memory at 8k/32k (d),
# attention numerics in bf16 (e); each stage in its own process under its own time budget (450 s together),
# one JSON (DIR/gpu_check.json, rewritten after every stage) and one table (stdout and DIR/gpu_check.txt).
# Exits non-zero only when a self-check fails; targets are reported as met / missed. Python side and the
# stage options: benchmarks/gpu_check.py (`bash scripts/gpu_check.sh --help`). Usage:
#
#   bash scripts/gpu_check.sh [--out DIR] [--stages a,b,c,d,e] [--budgets a=150] [stage options]
#   bash scripts/gpu_check.sh --smoke --out DIR     # anywhere (CPU), tiny sizes: checks the pipeline (CI)
#
# The GPU machine has jax 0.11.2, torch and transformers on Python 3.12 but no ml_collections, grain,
# array_record or portpicker, and no internet. Before the run, on a machine with internet, download the
# missing wheels into .whl/ (git-ignored):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl ml_collections grain array_record portpicker
#
# (ml_collections and portpicker are pure Python py3-none-any wheels; grain and array_record are binary cp312
# wheels; absl-py, PyYAML, etils, cloudpickle, protobuf and numpy are already there.) Carry .whl with the
# working tree (the device tool's carry: [".whl"]); where ml_collections or grain is missing this script
# installs them with `pip install --no-index --no-deps --target /tmp/site` and puts /tmp/site and the
# repository on PYTHONPATH. PYTHON=... chooses the interpreter (default python3).
# XLA_PYTHON_CLIENT_MEM_FRACTION defaults to 0.94 here so the largest batch can use most of the GPU's memory.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The carried wheels are a fallback: installed only where ml_collections or grain is missing (a cp312 wheel
# would not even install on another Python).
if ! "$PY" -c "import ml_collections, grain" 2>/dev/null && compgen -G ".whl/*.whl" > /dev/null; then
  rm -rf /tmp/site
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}
"$PY" -c "import ml_collections, tformer_jax.config" 2>/dev/null \
  || { echo "self-check failed: cannot import ml_collections / tformer_jax (see the header of $0)"; exit 1; }
exec "$PY" benchmarks/gpu_check.py "$@"
