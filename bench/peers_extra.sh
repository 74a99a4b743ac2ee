#!/usr/bin/env bash
# After ../shared/peers/prepare.sh: adds flash-linear-attention 0.6.0 (fla.layers, pure Python, ~400 KB) to the third
# carry folder, so that `gdn bench --ops layer` times fla's GatedDeltaNet layer in the same run (the peer pack carries
# fla-core only, which has no fla.layers). install-on-gpu.sh unpacks every wheel of /root/peers, this one included.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 flash-linear-attention==0.6.0 -d .peers/c3 2>&1 | grep -v WARNING || true
ls .peers/c3/flash_linear_attention-0.6.0-*.whl
