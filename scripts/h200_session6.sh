#!/usr/bin/env bash
# Session 6 (2026-12-03) on one H200, in device calls:
#   PART=a OUT=/some/dir bash scripts/h200_session6.sh
# PART a (issues 5 and 3, measured alone on the GPU): `oomb.bench.offload` on Qwen2.5-7B
#   1. per-stream profiles (oomb/bench/timeline.py: busy/idle time per stream and the compute
#      stream's kernel time by group) of one dense 64K step and one sparse 128K step (select block
#      4096), each without and with offload: where the offload overhead goes, and where a dense
#      step's time goes against transformers' (issue 3);
#   2. the overhead pairs again, with the high-priority copy stream and the sync-free single page
#      list: dense 64K, sparse 128K with select blocks 4096 and 128;
#   then `oomb.bench.core` at 64K with chunk 8192 (against chunk 4096's 17.31 / 15.40 s).
# PART b (issues 5 and 4, alone on the GPU): the overhead pairs again, each timed at steady state (one
#   step at the row's length first, as a run's first step that allocates and pins the store; then the
#   timed step): dense 64K, sparse 128K with select blocks 4096 and 128; then the stream profile of the
#   sparse 128K step with the compute stream's idle gaps by the ops around them; then oomb.bench.core's
#   sparse 128K step with chunk 8192, plain and with cache_attention (issue 4's <= 20 s target).
# PART c: the GPU test of host syncs per step (tests/engine/test_gpu_syncs.py); the sparse 128K step of
#   Qwen2.5-7B after the sync fix (oomb.bench.core, plain and cached; issue 4's <= 20 s target); then issue
#   4's quality study (`python -m oomb.bench.sparse_quality`) with the time left (it writes after each phase).
# Every bench writes its JSON after each row. Everything under $W, a tar in $OUT. BUDGET bounds it.
set -uo pipefail
DEFAULT_BUDGET=540
# shellcheck source=scripts/h200_env.sh
source "$(dirname "$0")/h200_env.sh"
require_part a b c
record_machine

if [[ $PART == a ]]; then
  part "offload bench, Qwen2.5-7B: stream profiles, then the overhead pairs"
  t=$(limit 100)
  # shellcheck disable=SC2086
  timeout "$t" python3 -m oomb.bench.offload --time-budget $(( t - 60 )) --out "$W/offload_7b.json" \
    --preset qwen2.5-7b --chunk 4096 --profile-dense-length 65536 --profile-length 131072 \
    --dense-lengths 65536 --sparse-lengths 131072 --growth-lengths "" --select-blocks 4096,128 \
    ${BENCH_EXTRA:-} > "$W/offload_7b.log" 2>&1
  echo "offload exit $? (timeout $t s)"; tail -30 "$W/offload_7b.log" | cut -c1-400

  part "core bench, Qwen2.5-7B at 64K with chunk 8192"
  t=$(limit 5)
  if [ "$t" -gt 0 ]; then
    timeout "$t" python3 -m oomb.bench.core --lengths 65536 --cache-lengths 65536 --chunk 8192 \
      --out "$W/core_chunk8192.json" > "$W/core_chunk8192.log" 2>&1
    echo "core exit $?"; tail -12 "$W/core_chunk8192.log" | cut -c1-300
  fi
elif [[ $PART == b ]]; then
  part "offload bench, Qwen2.5-7B: steady-state overhead pairs, then the sparse stream profile"
  t=$(limit 90)
  # shellcheck disable=SC2086
  timeout "$t" python3 -m oomb.bench.offload --time-budget $(( t - 60 )) --out "$W/offload_7b_steady.json" \
    --preset qwen2.5-7b --chunk 4096 --dense-lengths 65536 --sparse-lengths 131072 --growth-lengths "" \
    --select-blocks 4096,128 ${BENCH_EXTRA:-} > "$W/offload_7b_steady.log" 2>&1
  echo "offload exit $? (timeout $t s)"; tail -14 "$W/offload_7b_steady.log" | cut -c1-300
  t=$(limit 85)
  if [ "$t" -gt 0 ]; then
    # shellcheck disable=SC2086
    timeout "$t" python3 -m oomb.bench.offload --out "$W/offload_7b_profile.json" --preset qwen2.5-7b --chunk 4096 \
      --profile-length 131072 --dense-lengths "" --sparse-lengths "" --growth-lengths "" --select-blocks 4096 \
      ${BENCH_EXTRA:-} > "$W/offload_7b_profile.log" 2>&1
    echo "profile exit $? (timeout $t s)"; grep -A9 "^profile" "$W/offload_7b_profile.log" | cut -c1-300
  fi

  part "core bench, Qwen2.5-7B sparse 128K with chunk 8192"
  t=$(limit 3)
  if [ "$t" -gt 0 ]; then
    timeout "$t" python3 -m oomb.bench.core --lengths "" --sparse-lengths 131072 --sparse-cache-lengths 131072 \
      --chunk 8192 --out "$W/core_sparse_chunk8192.json" > "$W/core_sparse_chunk8192.log" 2>&1
    echo "core exit $?"; tail -6 "$W/core_sparse_chunk8192.log" | cut -c1-300
  fi
elif [[ $PART == c ]]; then
  part "GPU test: a step's host syncs do not grow with its chunks"
  timeout 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/engine/test_gpu_syncs.py \
    > "$W/gpu_syncs.log" 2>&1
  echo "tests exit $?"; grep -E "host syncs|passed|failed|Error" "$W/gpu_syncs.log" | tail -8

  part "core bench, Qwen2.5-7B sparse 128K (chunk 4096), plain and with cache_attention, after the sync fix"
  timeout 170 python3 -m oomb.bench.core --lengths "" --sparse-lengths 131072 --sparse-cache-lengths 131072 \
    --chunk 4096 --out "$W/core_sparse_128k.json" > "$W/core_sparse_128k.log" 2>&1
  echo "core exit $?"; tail -5 "$W/core_sparse_128k.log" | cut -c1-300

  part "sparse quality study (issue 4), with what is left"
  timeout "$(limit 5)" python3 -m oomb.bench.sparse_quality --out "$W/sparse_quality" --data-workers 12 \
    > "$W/sparse_quality.log" 2>&1
  echo "sparse_quality exit $?"; tail -6 "$W/sparse_quality.log" | cut -c1-300
  if [ -f "$W/sparse_quality/sparse_quality.md" ]; then head -80 "$W/sparse_quality/sparse_quality.md"; fi
  rm -rf "$W/sparse_quality/dense_model"
fi
part "done"
tar czf "$OUT/session6-$PART.tar.gz" -C "$W" --exclude='*.safetensors' --exclude='*.pt' --exclude=checkpoints \
  --exclude=export .
