#!/usr/bin/env bash
# Session 8 (2026-12-03) on one H200, one part per device call:
#   PART=a bash scripts/h200_session8.sh   # issue 4: the GPU host-sync test, then the whole sparse quality study
#   PART=b bash scripts/h200_session8.sh   # issue 3: fused-dQ kernels and fused ops, timed; issue 4: the bound arm
# PART a: tests/engine/test_gpu_syncs.py (its bound changed in session 7, not run on the GPU since), then
#   `python -m oomb.bench.sparse_quality` with every budget and selection option (bound included) and the
#   sparse-trained arm: the study writes its JSON and markdown after each phase, so a cut keeps what ran.
# PART b: the GPU tests of the kernels (fused-dQ cases) and of the fused ops; `oomb.bench.tune_attention` over
#   the fused-dQ backward candidates at kv 64K; `oomb.bench.core` on Qwen2.5-7B with liger's fused ops and the
#   fastest matching backward: dense 64K and 128K with cache_attention, sparse 128K cached; the quality study's
#   sparse arm with `bound` selection (no gradient study); then, with the time left, the 64K cached step
#   without fused ops and with the default tiles (the same-run baselines of the two changes).
# Everything under $W, a tar in $OUT. BUDGET bounds it.
set -uo pipefail
DEFAULT_BUDGET=560
# shellcheck source=scripts/h200_env.sh
source "$(dirname "$0")/h200_env.sh"
require_part a b
record_machine

if [[ $PART == a ]]; then
  part "GPU test: host syncs per step"
  timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_gpu_syncs.py > "$W/gpu_syncs.log" 2>&1
  echo "tests exit $?"; grep -E "passed|failed|Error|assert" "$W/gpu_syncs.log" | tail -8

  part "sparse quality study (every phase)"
  timeout "$(limit 5)" python3 -m oomb.bench.sparse_quality --out "$W/sparse_quality" --data-workers 12 \
    > "$W/sparse_quality.log" 2>&1
  echo "sparse_quality exit $?"; tail -6 "$W/sparse_quality.log" | cut -c1-300
  if [ -f "$W/sparse_quality/sparse_quality.md" ]; then cat "$W/sparse_quality/sparse_quality.md" | head -120; fi
  rm -rf "$W/sparse_quality/dense_model" "$W/sparse_quality/sparse_model"
elif [[ $PART == b ]]; then
  part "GPU tests: kernels (fused-dQ cases), fused ops"
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_triton_attention.py \
    tests/engine/test_fused_ops.py > "$W/gpu_tests.log" 2>&1
  tests_rc=$?
  echo "tests exit $tests_rc"; grep -E "passed|failed|Error|FAILED" "$W/gpu_tests.log" | tail -12

  part "backward candidates at kv 64K"
  timeout 150 python3 -m oomb.bench.tune_attention --kv-len 65536 \
    --candidates default,dq-fused,dq-fused-m32,dq-fused-m32-4st,dq-fused-2st --out "$W/tune_64k.json" \
    > "$W/tune_64k.log" 2>&1
  echo "tune exit $?"; tail -8 "$W/tune_64k.log" | cut -c1-300
  # The fastest backward whose results match the default's (bf16 rounding), if the GPU tests passed.
  best=$(python3 - "$W/tune_64k.json" "$tests_rc" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["results"]
except (OSError, ValueError, KeyError):
    rows = []
ok = [r for r in rows if "error" not in r and r["max_rel_diff_vs_default"] < 1e-2]
print(min(ok, key=lambda r: r["bwd_ms"])["name"] if ok and sys.argv[2] == "0" else "default")
PY
)
  echo "tiles for the core steps: $best"

  part "core steps, Qwen2.5-7B, fused ops + $best tiles"
  timeout "$(limit 300)" python3 -m oomb.bench.core --lengths "" --cache-lengths 65536,131072 \
    --sparse-cache-lengths 131072 --fused-ops auto --tiles "$best" --out "$W/core_fused.json" \
    > "$W/core_fused.log" 2>&1
  echo "core exit $?"; grep -E '^\{' "$W/core_fused.log" | cut -c1-260

  part "sparse quality: the sparse arm with bound selection"
  timeout "$(limit 60)" python3 -m oomb.bench.sparse_quality --out "$W/sparse_quality_bound" --data-workers 12 \
    --learn-options bound --no-gradient-study > "$W/sparse_quality_bound.log" 2>&1
  echo "sparse_quality exit $?"; tail -4 "$W/sparse_quality_bound.log" | cut -c1-300
  if [ -f "$W/sparse_quality_bound/sparse_quality.md" ]; then sed -n 1,40p "$W/sparse_quality_bound/sparse_quality.md"; fi
  rm -rf "$W/sparse_quality_bound/dense_model"

  for variant in "none default" "auto default"; do
    set -- $variant
    if [ "$(limit 55)" -gt 0 ] && { [ "$2" != "$best" ] || [ "$1" != auto ]; }; then
      part "core step, 64K cached, fused ops $1, tiles $2"
      timeout "$(limit 5)" python3 -m oomb.bench.core --lengths "" --cache-lengths 65536 --fused-ops "$1" \
        --tiles "$2" --out "$W/core_$1_$2.json" > "$W/core_$1_$2.log" 2>&1
      echo "core exit $?"; grep -E '^\{' "$W/core_$1_$2.log" | cut -c1-260
    fi
  done
fi
part "done"
tar czf "$OUT/session8-$PART.tar.gz" -C "$W" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' .
