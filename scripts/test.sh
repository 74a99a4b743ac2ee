#!/usr/bin/env bash
# The test command: set up, then run the whole suite. Without a GPU the Triton kernels run in Triton's interpreter
# (tests/conftest.py sets TRITON_INTERPRET=1 when CUDA is absent).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# --- engine sources (issue 18): vLLM / SGLang GDN entry-point files for the signature test; no network = snapshot ---
GDN_ENGINE_SRC=$(bash scripts/engine_sources.sh 2>/dev/null | tail -n 1) || true
export GDN_ENGINE_SRC
# ---
exec "${PYTHON:-python3}" -m pytest -q -n 2 tests "$@"
