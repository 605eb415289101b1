#!/usr/bin/env bash
# One device session: GPU tests, then the benchmarks, results under $OUT (or ./out).
# Usage on the H200 machine, from the repo root:  bash scripts/h200_check.sh [core|attention|all]
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels missing on the machine (liger-kernel)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python3 -m pytest -q -s -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "error|passed|failed|FAIL" | tail -25
if [[ $what == attention || $what == all ]] && [[ -f oomb/bench/attention.py ]]; then
  python3 -m oomb.bench.attention --out "$OUT/attention_h200.json" 2>&1 | tee "$OUT/attention.log" | tail -15
fi
if [[ $what == core || $what == all ]]; then
  python3 -m oomb.bench.core --out "$OUT/core_h200.json" ${CORE_ARGS:---hf-lengths 16384,32768} 2>&1 \
    | tee "$OUT/core.log" | tail -15
fi
