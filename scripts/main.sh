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
"$VENV/bin/python" -m pip install -q -e .
"$VENV/bin/python" scripts/train.py --config=configs/shakespeare_char.py --workdir="$WORKDIR" "$@"
"$VENV/bin/python" scripts/generate.py --workdir="$WORKDIR" --prompt="ROMEO:" --prompt="JULIET:" \
  --max_new_tokens=300 --temperature=0.8
