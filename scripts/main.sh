#!/usr/bin/env bash
# The main job on a fresh machine: install, train the default config on Shakespeare (2 CPU cores,
# < 10 min of training), then sample from the trained model.
# Usage: bash scripts/main.sh [WORKDIR] [extra --config.x=y overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
WORKDIR=${1:-runs/shakespeare}; shift || true
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[cpu]"   # cpu: the C++ CPU kernels' OpenBLAS (CPU training speed)
# Optional: tcmalloc makes XLA:CPU train steps up to ~30% faster (tformer_jax/backends/cpu/host_alloc.py); runs without it.
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4) >/dev/null 2>&1 \
    || echo "note: libtcmalloc-minimal4 not installed (glibc's hugetlb tunable is used instead)"
fi
"$VENV/bin/python" scripts/train.py --config=configs/shakespeare_char.py --workdir="$WORKDIR" "$@"
"$VENV/bin/python" scripts/generate.py --workdir="$WORKDIR" --prompt="ROMEO:" --prompt="JULIET:" \
  --max_new_tokens=300 --temperature=0.8
