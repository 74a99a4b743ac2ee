#!/usr/bin/env bash
# The test command: set up, then run the whole suite on the installed Triton. Without a GPU the Triton kernels run in
# Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when CUDA is absent); tests/kernels/test_aot_sm90.py
# compiles every kernel configuration for sm_90 with the same Triton.
# In CI (CI=true) or with GDN_TEST_TRITON39=1 the suite first runs on Triton 3.9.0 as well, from a virtual environment
# (created once under ${GDN_CACHE:-~/.cache/gdn}) that sees this Python's packages and adds only triton==3.9.0; its
# result is printed before the main run, whose pytest summary stays the last line; either failing fails the script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
# --- engine sources (issue 18): vLLM / SGLang GDN entry-point files for the signature test; no network = snapshot ---
GDN_ENGINE_SRC=$(bash scripts/engine_sources.sh 2>/dev/null | tail -n 1) || true
export GDN_ENGINE_SRC
# ---

rc_extra=0
if [ "${CI:-}" = true ] || [ "${GDN_TEST_TRITON39:-0}" = 1 ]; then
  venv=${GDN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gdn}/venv-triton-3.9.0
  if ! "$venv/bin/python" -c "import sys, triton; sys.exit(triton.__version__ != '3.9.0')" >/dev/null 2>&1; then
    rm -rf "$venv"
    "$PY" -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install -q triton==3.9.0
  fi
  echo "== Triton 3.9.0: the whole suite (interpreter, sm_90 compile) =="
  PYTHONPATH="$PWD/src" "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider tests || rc_extra=$?
  if [ "$rc_extra" -ne 0 ]; then
    echo "== Triton 3.9.0: FAILED (exit $rc_extra); the run on the installed Triton follows ==" >&2
  else
    echo "== Triton 3.9.0: passed =="
  fi
  echo "== Triton $("$PY" -c 'import triton; print(triton.__version__)'): the whole suite =="
fi
rc=0
"$PY" -m pytest -q -n 2 tests "$@" || rc=$?
if [ "$rc" -eq 0 ] && [ "$rc_extra" -ne 0 ]; then
  exit "$rc_extra"
fi
exit "$rc"
