#!/usr/bin/env bash
# Installs gdn in editable mode with its test tools. Keeps an existing torch (a CUDA build on a GPU machine is never
# replaced); where none is installed, takes torch 2.13.0 (on the CPU machines of this project, a CPU wheel on local disk).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q torch==2.13.0
fi
extras="test"
"$PY" -c "import transformers" >/dev/null 2>&1 || extras="test,transformers"
"$PY" -m pip install -q -e ".[$extras]"
