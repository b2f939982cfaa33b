#!/usr/bin/env bash
# GPU run on a box without uv or network (the H200): plain python3, our sources on PYTHONPATH, megatron-core
# from a wheel in .whl/ if it is not installed. Writes logs and benchmark JSON under ${OUT:-.gpu-out}.
#   bash ci/gpu.sh [tests|bench|all] [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}; shift || true
out=${OUT:-.gpu-out}; mkdir -p "$out"
if ! python3 -c 'import megatron.core' 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "megatron-core is missing: put megatron_core-0.19.2 (and other missing wheels) in .whl/" >&2
  fi
fi
for s in packages/*/src; do PYTHONPATH="$PWD/$s:${PYTHONPATH:-}"; done
export PYTHONPATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu-info.txt"
rc=0
if [ "$mode" = tests ] || [ "$mode" = all ]; then
  python3 -m pytest -p dsv4_testkit.plugin packages/*/tests -m gpu -q "$@" 2>&1 | tee "$out/gpu-tests.log"
  rc=${PIPESTATUS[0]}; [ "$rc" = 5 ] && rc=0
fi
if [ "$mode" = bench ] || [ "$mode" = all ]; then
  for b in packages/*/benchmarks/bench_*.py; do
    [ -f "$b" ] || continue
    echo "=== $b"; python3 "$b" --out "$out" 2>&1 | tee -a "$out/bench.log" || rc=1
  done
fi
exit $rc
