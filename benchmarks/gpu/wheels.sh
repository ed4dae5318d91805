#!/usr/bin/env bash
# What kvtier needs beyond a lent GPU machine's image (PyTorch 2.11 + CUDA 13, Python 3.12, no
# vLLM, no network; KINDS.md lists the image's packages), downloaded here, on a machine with a
# package index, into benchmarks/gpu/wheels/ (git-ignored; it travels with the working tree:
# the device tool's `carry`). benchmarks/gpu/check.sh installs them there offline.
#   bash benchmarks/gpu/wheels.sh          # prints each wheel and the total (about 8 MiB)
set -euo pipefail
cd "$(dirname "$0")"
DEST=wheels
PY="${PYTHON:-python3}"
# The image has torch, numpy, cupy-cuda13x, cuda-toolkit / nvidia-cufile, cuda-pathfinder,
# packaging, xxhash, pyyaml, prometheus-client, tqdm: not carried. Each package below is taken
# without its dependencies (--no-deps): the list is the closure of what the image lacks.
PKGS=(lmdb pydantic pydantic-core annotated-types typing-inspection typing-extensions
      redis hiredis kvikio-cu13 libkvikio-cu13 rapids-logger)
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$DEST" "${PKGS[@]}" 2>&1 | grep -v 'is ignored: it is neither' || true
for p in "${PKGS[@]}"; do
  n=${p//-/_}
  ls "$DEST"/ | grep -qi "^${n}-" || { echo "wheels.sh: no wheel for $p in $DEST" >&2; exit 1; }
done
ls -l "$DEST"/*.whl | awk '{printf "%9d  %s\n", $5, $9}'
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "wheels.sh: $(ls "$DEST"/*.whl | wc -l) wheels, total $total bytes ($(awk "BEGIN{printf \"%.1f\", $total / 1048576}") MiB) in benchmarks/gpu/$DEST"
[ "$total" -lt $((40 << 20)) ] || { echo "wheels.sh: over 40 MiB: too large to travel" >&2; exit 1; }
