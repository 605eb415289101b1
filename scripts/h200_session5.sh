#!/usr/bin/env bash
# Issue 5's offload measurements on one H200, in three device calls (session 5, 2026-12-02).
#   PART=a OUT=/some/dir bash scripts/h200_session5.sh   # GPU offload test, 7B offload bench
#   PART=b OUT=/some/dir bash scripts/h200_session5.sh   # copy bench, sparse 128K overhead, 7B longest context
#   PART=c OUT=/some/dir bash scripts/h200_session5.sh   # 0.5B longest context, 20 steps, copy bench
# PART a: the GPU offload test of tests/engine/test_gpu_bf16.py (offload vs device store, bit for bit), then
#   `oomb.bench.offload` on Qwen2.5-7B: the offload overhead pairs (dense 64K, sparse 128K with select
#   blocks 4096 and 128), then GPU memory growth 64K -> 512K with block 4096, then with block 128
#   (--select-blocks order = row order: the most important rows first).
# PART b: `oomb.bench.copy` (copy engine against the copy kernel), the sparse 128K overhead pair, then one
#   sparse + offload step at the longest context of Qwen2.5-7B (1M, then shorter fallbacks only if 1M
#   does not run: --longest-first-fit), refused by the bench (nothing lost) where the planner or the free
#   host memory says it does not fit.
# PART c: the same for Qwen2.5-0.5B at 4M, then 20 consecutive sparse + offload steps of 0.5B (RSS and
#   pinned bytes after each), then the copy bench if time is left.
# Every bench writes its JSON after each row (a run cut off by its timeout keeps what it did and names
# the row it was in: "in_progress"). Everything under $W, a tar in $OUT. BUDGET (s) bounds the part.
# Env: LONGEST_7B, LONGEST_05B (lengths, longest first), LONGEST_BLOCK and REPEAT_BLOCK (select block,
# default 4096: far fewer pages move per chunk than with 128), REPEAT_LEN, GROWTH, BLOCKS,
# HOST_MARGIN_GIB (default 4), BENCH_EXTRA (appended to every bench command; later options win), e.g. a
# CPU check of this script:
#   BENCH_EXTRA="--device cpu --dtype float32 --preset tiny --chunk 32 --page 8 --budget 2 --dense-lengths 64
#   --sparse-lengths 128 --growth-lengths 64,128 --longest-lengths 256 --repeat-length 96 --repeat-steps 3
#   --select-blocks 32,16" W=/tmp/w OUT=/tmp/o PART=a bash scripts/h200_session5.sh
set -uo pipefail
DEFAULT_BUDGET=480
# shellcheck source=scripts/h200_env.sh
source "$(dirname "$0")/h200_env.sh"
require_part a b c
record_machine
MARGIN=${HOST_MARGIN_GIB:-4}
NOSPLIT=(--dense-lengths "" --sparse-lengths "" --growth-lengths "")

bench() {  # bench NAME TIMEOUT ARGS...: the offload bench, its JSON and log under $W
  local name=$1 t=$2; shift 2
  if [ "$t" -le 0 ]; then echo "$name: skipped, no time left"; return; fi
  # shellcheck disable=SC2086  # BENCH_EXTRA is split into words on purpose
  timeout "$t" python3 -m oomb.bench.offload --time-budget $(( t - 40 > 0 ? t - 40 : 1 )) --out "$W/$name.json" "$@" \
    ${BENCH_EXTRA:-} > "$W/$name.log" 2>&1
  echo "$name exit $? (timeout $t s)"; tail -25 "$W/$name.log"
}

if [[ $PART == a ]]; then
  part "GPU offload test (bf16: dense, sparse through the copy kernel, layers kept on the GPU)"
  timeout 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/engine/test_gpu_bf16.py -k offload \
    > "$W/gpu_tests.log" 2>&1
  echo "tests exit $?"; grep -E "passed|failed|FAIL|Error" "$W/gpu_tests.log" | tail -8

  part "offload bench, Qwen2.5-7B: overhead pairs, growth (block 4096, then 128)"
  bench offload_7b "$(limit 15)" --preset qwen2.5-7b --dense-lengths 65536 --sparse-lengths 131072 \
    --growth-lengths "${GROWTH:-65536,131072,262144,524288}" --select-blocks "${BLOCKS:-4096,128}" --chunk 4096
elif [[ $PART == b ]]; then
  part "page copies: copy engine against the copy kernel configurations, alone and beside a matmul"
  timeout 90 python3 -m oomb.bench.copy --out "$W/copy.json" > "$W/copy.log" 2>&1; echo "copy exit $?"
  tail -40 "$W/copy.log" | cut -c1-220

  part "sparse 128K offload overhead with the persistent copy kernel, Qwen2.5-7B"
  bench overhead_7b 120 --preset qwen2.5-7b --dense-lengths "" --sparse-lengths 131072 --growth-lengths "" \
    --select-blocks "${BLOCKS:-4096}" --chunk 4096

  part "longest context, Qwen2.5-7B"
  bench longest_7b "$(limit 5)" --preset qwen2.5-7b "${NOSPLIT[@]}" \
    --longest-lengths "${LONGEST_7B:-1048576,983040,917504}" --longest-first-fit \
    --select-blocks "${LONGEST_BLOCK:-4096}" --chunk 4096 --host-margin-gib "$MARGIN"
else
  part "longest context, Qwen2.5-0.5B"
  bench longest_05b "$(limit 100)" --preset qwen2.5-0.5b "${NOSPLIT[@]}" \
    --longest-lengths "${LONGEST_05B:-4194304,3670016,3145728}" --longest-first-fit \
    --select-blocks "${LONGEST_BLOCK:-4096}" --chunk 4096 --host-margin-gib "$MARGIN"

  part "20 sparse + offload steps, Qwen2.5-0.5B (host memory growth)"
  bench repeat_05b "$(limit 45)" --preset qwen2.5-0.5b "${NOSPLIT[@]}" --repeat-steps 20 \
    --repeat-length "${REPEAT_LEN:-131072}" --select-blocks "${REPEAT_BLOCK:-4096}" --chunk 4096

  part "page copies: copy engine against the copy kernel configurations, alone and beside a matmul"
  timeout "$(limit 3)" python3 -m oomb.bench.copy --out "$W/copy.json" > "$W/copy.log" 2>&1; echo "copy exit $?"
  tail -40 "$W/copy.log" | cut -c1-220
fi
part "done"
free -b >> "$W/free.txt"
tar czf "$OUT/session5-$PART.tar.gz" -C "$W" --exclude='*.safetensors' --exclude='*.pt' --exclude=checkpoints \
  --exclude=export .
