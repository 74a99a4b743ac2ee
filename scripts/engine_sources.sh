#!/usr/bin/env bash
# Unpacks the pure-Python files that hold vLLM's and SGLang's GDN kernel entry points (never installs anything) into
# a cache dir, for tests/integrations/test_engine_signatures.py (which reads them with `ast`):
#   scripts/engine_sources.sh            -> $GDN_ENGINE_SRC (default ~/.cache/gdn/engine_src), prints that dir
#   scripts/engine_sources.sh --snapshot -> also rewrites tests/integrations/engine_signatures.json from them
# Versions: VLLM_VERSION (0.33.0), SGLANG_VERSION (0.5.23). Without network the test uses the committed snapshot.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
DEST=${GDN_ENGINE_SRC:-${XDG_CACHE_HOME:-$HOME/.cache}/gdn/engine_src}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
FILES=$("$PY" tests/integrations/test_engine_signatures.py --files)
mkdir -p "$DEST"
for spec in "vllm==$VLLM_VERSION" "sglang==$SGLANG_VERSION"; do
  name=${spec%%==*}
  marker="$DEST/.$spec"
  [ -f "$marker" ] && continue
  tmp=$(mktemp -d)
  if "$PY" -m pip download -q --no-deps "$spec" -d "$tmp" >/dev/null 2>&1; then
    "$PY" - "$tmp" "$DEST" $FILES <<'PYEOF'
import glob, sys, zipfile
tmp, dest, files = sys.argv[1], sys.argv[2], sys.argv[3:]
for whl in glob.glob(tmp + "/*.whl"):
    z = zipfile.ZipFile(whl)
    names = set(z.namelist())
    z.extractall(dest, members=[f for f in files if f in names])
PYEOF
    touch "$marker"
  else
    echo "engine_sources: could not download $spec (no network?); the signature test uses the snapshot" >&2
  fi
  rm -rf "$tmp"
done
if [ "${1:-}" = "--snapshot" ]; then
  GDN_ENGINE_SRC="$DEST" "$PY" tests/integrations/test_engine_signatures.py --snapshot
fi
echo "$DEST"
