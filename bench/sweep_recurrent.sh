#!/usr/bin/env bash
# Multi-token (speculative verify) tilings on the GPU: `gdn bench --ops recurrent` once with the peers, then once per
# GDN_RECURRENT_CFG variant (BV:warps:stages) without them; a table of gdn ms per case and variant last.
#   CFGS="32:4:1 8:2:1" MATCH=fp32 bash bench/sweep_recurrent.sh      (results under $OUT/rec_*)
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; HDR=${HDR:-bench/results/_hdr.json}; MATCH=${MATCH:-fp32}
python3 -m gdn.cli bench --ops recurrent --match "$MATCH" --resume-from "$HDR" --out "$OUT/rec_peers" --no-plot \
  > "$OUT/rec_peers.log" 2>&1
for c in ${CFGS:-32:4:1}; do
  GDN_RECURRENT_CFG=$c python3 -m gdn.cli bench --ops recurrent --match "$MATCH" --resume-from "$HDR" --no-peers \
    --out "$OUT/rec_${c//:/_}" --no-plot > "$OUT/rec_${c//:/_}.log" 2>&1
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
runs = {}
for f in sorted(glob.glob(os.path.join(out, "rec_*", "*.json"))):
    runs[os.path.basename(os.path.dirname(f))[4:]] = {r["key"]: r for r in json.load(open(f))["rows"]}
peers = runs.get("peers", {})
names = [n for n in runs if n != "peers"]
print("case".ljust(40), "FI".rjust(8), "fla".rjust(8), "default".rjust(8), *[n.rjust(8) for n in names])
for key, r in peers.items():
    f = lambda x: f"{x:8.4f}" if x else "       -"
    print(key.split("|", 1)[1][:40].ljust(40), f(r.get("flashinfer_ms")), f(r.get("fla_ms")), f(r.get("gdn_ms")),
          *[f(runs[n].get(key, {}).get("gdn_ms")) for n in names])
PY
