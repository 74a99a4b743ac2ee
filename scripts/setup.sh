#!/usr/bin/env bash
# Installs gdn in editable mode with its test tools. Never installs or replaces torch, Triton or numpy where they are
# present (a CUDA torch, the Triton it brought, the user's numpy stay as they are; checked at the end):
# - torch: only where none is importable, torch==2.13.0 (on this project's CPU machines a CPU wheel on local disk);
# - Triton: only where none is importable (Linux), triton==3.6.0, the version the GPU machines run;
# - gdn itself with --no-deps, then the test tools of pyproject's `test` extra (and `transformers` where absent)
#   under constraints that hold the present torch / Triton / numpy at their versions.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install -q "$@"; }

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  pip_install torch==2.13.0
fi
if [ "$(uname -s)" = Linux ] && ! "$PY" -c "import triton" >/dev/null 2>&1; then
  pip_install triton==3.6.0
fi

# versions of the three packages as imported (a `pytorch-triton` distribution counts as Triton) and, for the pip
# constraints, as installed distributions
versions() { "$PY" - <<'EOF'
import importlib
for m in ("torch", "triton", "numpy"):
    try:
        print(f"{m} {importlib.import_module(m).__version__}")
    except ImportError:
        print(f"{m} absent")
EOF
}
before=$(versions)
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$PY" - >"$constraints" <<'EOF'
from importlib import metadata
for d in ("torch", "triton", "pytorch-triton", "numpy"):
    try:
        print(f"{d}=={metadata.version(d)}")
    except metadata.PackageNotFoundError:
        pass
EOF

# the `test` extra of pyproject.toml (and `transformers` where absent) by name: pip's `.[test]` would also pull gdn's
# own dependencies
extras="test"
"$PY" -c "import transformers" >/dev/null 2>&1 || extras="test transformers"
# shellcheck disable=SC2086
tools=$("$PY" - $extras <<'EOF'
import re, sys
text = open("pyproject.toml").read()
for extra in sys.argv[1:]:
    body = re.search(rf"^{extra}\s*=\s*\[(.*?)\]", text, re.M | re.S).group(1)
    print(" ".join(re.findall(r'"([^"]+)"', body)))
EOF
)
pip_install --no-deps -e .
# shellcheck disable=SC2086
pip_install -c "$constraints" $tools

after=$(versions)
if [ "$before" != "$after" ]; then
  echo "scripts/setup.sh: torch / Triton / numpy changed while installing the test tools (a bug in this script):" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  exit 1
fi
