#!/usr/bin/env bash
# The one command for a lent GPU machine (PyTorch + CUDA, Python 3.12, no vLLM, no network):
#   bash benchmarks/gpu/check.sh [--cpu] [--out FILE]
# 1. kvtier's own requirements the image lacks come from benchmarks/gpu/wheels/ (made by wheels.sh on
#    a machine with an index; carried with the tree), installed offline into a temporary --target;
# 2. kvtier is imported from this tree as it is (pyproject's package-dir mapping, by symlinks);
# 3. benchmarks/gpu/check.py drives the worker's data path on CUDA tensors in vLLM's layouts, one
#    line per check, its figures in one JSON file ($OUT/gpu_check.json, or --out).
# Exits non-zero without CUDA; --cpu runs the same harness without one (GPU-only checks skipped).
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY="${PYTHON:-python3}"
case "$PY" in /*) ;; */*) PY="$ROOT/$PY" ;; *) PY="$(command -v "$PY" || echo "$PY")" ;; esac
MODE=gpu
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu; ARGS+=(--cpu) ;;
    --out) ARGS+=(--out "$2"); shift ;;
    *) echo "check.sh: unknown argument $1 (use --cpu, --out FILE)" >&2; exit 64 ;;
  esac
  shift
done
pyc() { (cd "${TMPDIR:-/tmp}" && "$PY" -c "$1"); }   # not from the tree's root: its kvtier/ is not the package
if ! pyc 'import torch' 2>/dev/null; then
  echo "check.sh: $PY has no torch: FAIL" >&2; exit 3
fi
if [ $MODE = gpu ] && ! pyc 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "check.sh: no CUDA device (torch.cuda.is_available() is False): FAIL; 'check.sh --cpu' runs the harness without one" >&2
  exit 2
fi
need='import lmdb, pydantic, redis, xxhash, yaml'
[ $MODE = gpu ] && need="$need, kvikio"
if ! pyc "$need" 2>/dev/null; then
  WH=benchmarks/gpu/wheels
  if ! ls "$WH"/*.whl >/dev/null 2>&1; then
    echo "check.sh: missing packages ($need) and no wheels in $WH: run benchmarks/gpu/wheels.sh where an index is reachable" >&2
    exit 3
  fi
  SITE="${TMPDIR:-/tmp}/kvtier-check-site"
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$SITE" "$WH"/*.whl || {
    echo "check.sh: pip install --no-index from $WH failed" >&2; exit 3; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "check.sh: installed $(ls "$WH"/*.whl | wc -l) wheels offline into $SITE"
fi
if ! pyc 'import kvtier.connector.worker' 2>/dev/null; then
  PKG="${TMPDIR:-/tmp}/kvtier-check-src"
  rm -rf "$PKG" && mkdir -p "$PKG/kvtier"
  for f in "$ROOT"/kvtier/*; do ln -s "$f" "$PKG/kvtier/"; done
  for d in tiers policies connector configs; do ln -s "$ROOT/$d" "$PKG/kvtier/$d"; done
  export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
fi
exec timeout 290 "$PY" benchmarks/gpu/check.py ${ARGS[@]+"${ARGS[@]}"}
