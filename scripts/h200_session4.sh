#!/usr/bin/env bash
# One ~9-minute device call (session 4, 2026-12-02): the planner's refusal on the GPU (issue 8), the
# new sparse dK/dV launch checked in bf16, the Qwen2.5-7B steps beside transformers (issue 3, 4), the
# sparse kernel speedups, then forward tile candidates if time is left. Everything under $W, a tar in $OUT.
#   OUT=/some/dir bash scripts/h200_session4.sh
set -uo pipefail
# shellcheck source=scripts/h200_env.sh
source "$(dirname "$0")/h200_env.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$W/gpu.txt"

part "planner refusal (faults part 3)"
mkdir -p "$W/ref" && cp results/h200/faults-2026-12-02/reference-metrics.jsonl "$W/ref/metrics.jsonl"
OUT=$W timeout 90 python3 scripts/h200_faults.py --reference "$W/ref/metrics.jsonl" --signals none --skip-oom \
  > "$W/faults.log" 2>&1; echo "faults exit $?"; tail -25 "$W/faults.log"

part "GPU kernel tests (page selection, bf16)"
timeout 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/kernels > "$W/gpu_tests.log" 2>&1
echo "tests exit $?"; grep -E "passed|failed|FAIL|Error" "$W/gpu_tests.log" | tail -8

part "core: Qwen2.5-7B steps, oomb (dense, cached, sparse) and transformers"
timeout $(( $(left) - 60 )) python3 -m oomb.bench.core --lengths 32768,65536,131072 --cache-lengths 65536,131072 \
  --sparse-lengths 131072 --sparse-cache-lengths 131072 --hf-lengths 65536,131072 --out "$W/core.json" \
  > "$W/core.log" 2>&1; echo "core exit $?"; tail -14 "$W/core.log"

part "sparse kernels against dense"
timeout $(( $(left) - 10 )) python3 -m oomb.bench.sparse --contexts 65536,131072,262144 --lengths "" \
  --out "$W/sparse.json" > "$W/sparse.log" 2>&1; echo "sparse exit $?"; tail -8 "$W/sparse.log"

if [ "$(left)" -gt 45 ]; then
  part "forward tile candidates at 16K"
  timeout $(( $(left) - 5 )) python3 -m oomb.bench.tune_attention --kv-len 16384 \
    --candidates default,fwd-n64,fwd-2st,fwd-4st,fwd-m64-w4 --out "$W/tune16k.json" > "$W/tune.log" 2>&1
  echo "tune exit $?"; tail -10 "$W/tune.log"
fi
part "done"
tar czf "$OUT/session4.tar.gz" -C "$W" --exclude='*.safetensors' --exclude='*.pt' --exclude=checkpoints --exclude=export .
