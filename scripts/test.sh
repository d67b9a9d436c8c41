#!/usr/bin/env bash
# Install tformer_jax with test + reference extras into a fresh venv, lint with ruff, and run the whole test suite.
# Usage: bash scripts/test.sh [extra pytest args]      (VENV=path to choose the venv; default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch pinned exactly: a CPU wheel; any looser spec pulls a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
# cpu: the C++ CPU kernels' OpenBLAS (the suite tests the kernels; tests/test_backends.py runs a CPU without it).
"$VENV/bin/python" -m pip install -q -e ".[test,reference,serve,gguf,cpu]"
# Ahead-of-time TPU compilation (tests/test_aot.py): the tpu-aot extra, i.e. the libtpu wheel (~210 MB) that
# jax[tpu] pins for the jax just installed (kept: no other jax is tried). Optional: without it those tests skip.
JAX_VERSION=$("$VENV/bin/python" -c "import jax; print(jax.__version__)")
# ml_dtypes 0.7.0 takes ~0.8 s to import (numpy searches its loop list once per ufunc loop registered:
# quadratic), against ~0.1 s for 0.6.0, and every process of the suite that imports jax pays it (50 or more in a
# run: the command-line tests, two-process runs, gpu_check's stages; 40-60 s of the two workers' time). jax, jaxlib
# and tensorstore need >=0.5. Kept at the jax just installed; where that jax needs 0.7, the newest is kept.
"$VENV/bin/python" -m pip install -q "ml_dtypes>=0.5,<0.7" "jax==$JAX_VERSION" \
  || echo "note: ml_dtypes kept at $("$VENV/bin/python" -c "import ml_dtypes; print(ml_dtypes.__version__)")"
"$VENV/bin/python" -m pip install -q -e ".[tpu-aot]" "jax==$JAX_VERSION" \
  || echo "note: libtpu not installed (the tpu-aot extra); tests/test_aot.py skips"
# oneMKL for the C++ kernels' sgemm (the mkl extra, ~230 MB; runtime.cpu_blas 'auto' takes it on Intel CPUs, so
# the suite runs what such a machine runs). Optional: without it the MKL cases of tests/test_cpu_matmul.py skip.
"$VENV/bin/python" -m pip install -q -e ".[mkl]" || echo "note: mkl not installed (the mkl extra); its tests skip"
# oneDNN's gemms for the kernels (the onednn extra, ~43 MB; 'auto' takes it for bf16 compute where MKL is not
# chosen, e.g. on AMD CPUs). Optional: without it the oneDNN cases of tests/test_cpu_matmul.py skip.
"$VENV/bin/python" -m pip install -q -e ".[onednn]" || echo "note: onednn not installed (the onednn extra); its tests skip"
# lm-evaluation-harness (tests/test_harness.py): the eval extra, with torch and jax kept at the versions just
# installed. Optional: without it those tests skip.
"$VENV/bin/python" -m pip install -q -e ".[eval]" "torch==2.13.0" "jax==$JAX_VERSION" \
  || echo "note: lm-eval not installed (the eval extra); tests/test_harness.py skips"
# Optional real corpus for the kjv tests (Debian); the suite skips those cases without it.
if ! command -v bible >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq bible-kjv) >/dev/null 2>&1 || echo "note: bible-kjv not installed"
fi
# Lint first (config in pyproject.toml [tool.ruff]; ruff comes with the test extra): a finding fails the script.
"$VENV/bin/ruff" check .
# A crashed worker (a segfault, or pytest-timeout ending a stuck test) ends the run, failed, instead of xdist
# restarting workers or waiting on one: --max-worker-restart=0.
exec "$VENV/bin/python" -m pytest -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0 "$@"
