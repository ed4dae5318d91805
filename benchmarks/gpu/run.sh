#!/usr/bin/env bash
# The CUDA path in one command, on a machine with an NVIDIA GPU:
#   1. installs vLLM's CUDA build (vllm==0.33.0) and kvtier[gds] into .venv-gpu (skipped with --no-install,
#      or when pip cannot reach an index: the kvtier-only checks still run);
#   2. runs the GPU tests (-m gpu) and, when vLLM is installed, the end-to-end tests on tiny random models,
#      eager and with CUDA graphs (KVTIER_E2E_CUDA_GRAPHS=1: FULL_AND_PIECEWISE, which kvtier turns piecewise);
#   3. measures scattered H2D/D2H against a pinned memcpy and kvikio against POSIX O_DIRECT, and appends
#      the rows to docs/results.md.
# Without a GPU it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "benchmarks/gpu/run.sh: no CUDA device here: skipped (nothing to measure)"
  exit 0
fi
VENV=.venv-gpu
if [ "${1:-}" != "--no-install" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
  if "$VENV/bin/python" -m pip install -q "vllm==0.33.0" && "$VENV/bin/python" -m pip install -q -e ".[dev,gds]"; then
    PY="$VENV/bin/python"
  else
    echo "benchmarks/gpu/run.sh: could not install vllm==0.33.0 / kvtier[gds] (no index?): the end-to-end tests are" \
         "skipped; running kvtier's own GPU checks with $PY" >&2
    "$PY" -m pip install -q --no-deps -e . 2>/dev/null || export PYTHONPATH="$PWD:${PYTHONPATH:-}"
  fi
fi
rc=0
"$PY" -m pytest -q -m gpu tests/ || rc=1
if "$PY" -c 'import vllm' 2>/dev/null; then
  "$PY" -m pytest -q tests/test_e2e_vllm.py tests/test_kv_layout.py || rc=1
  KVTIER_E2E_CUDA_GRAPHS=1 "$PY" -m pytest -q tests/test_e2e_vllm.py -k "second_pass or nvme_restart" || rc=1
fi
"$PY" benchmarks/gpu/copy_bench.py --results docs/results.md || rc=1
exit $rc
