#!/usr/bin/env bash
# Prepared in session 8 (2026-12-03) for the next session's device call on one H200 (not run yet):
#   PART=a bash scripts/h200_session9.sh   # ~350 s: the core steps (1, 2), the profile (4)
#   PART=b bash scripts/h200_session9.sh   # ~530 s: the quality study (3)
#   PART=c bash scripts/h200_session9.sh   # ~250 s: the offload race (5), added after part a
# 1. issue 3's step targets with chunk 8192 and the fused ops: `oomb.bench.core` dense 64K and 128K with
#    cache_attention (session 8 at chunk 4096: 14.52 / 44.32 s against targets of 14 / 43 s);
# 2. issue 4: the sparse 128K step (cached) with `bound` page scores, then with `mean`, one process each
#    (the cost of `bound` before it could become the default; session 8, mean: 22.04 s);
# 3. issue 4's quality study with its dense phase at 128K before the gradient study (the gradient rows at 128K
#    on a model that retrieves there) and sparse arms for `mean` and `bound` (it writes after each phase).
# 4. the sparse 128K step's stream profile with Python stacks: session 6 saw ~1,800 pageable host-to-device
#    copies per step, each draining the GPU's queue; `copies_by_op` names the line that queues them.
# 5. (added in session 9 after part a's offloaded sparse profile died of an illegal memory access) the
#    copy stream against page lists made on the compute stream: tests/offload/test_offload_streams.py
#    first on the store as it was (.old/store_before_fix.py, carried: `git show fbb3a6c:oomb/offload/store.py`,
#    expected to fail), then fixed, the offload bit-identity test, and the sparse 128K pair at one page
#    list per chunk (the configuration whose profile died) at steady state.
# Everything under $W, a tar in $OUT. BUDGET bounds it.
set -uo pipefail
DEFAULT_BUDGET=560
# shellcheck source=scripts/h200_env.sh
source "$(dirname "$0")/h200_env.sh"
require_part a b c
record_machine

core() {  # core NAME ARGS...: one oomb.bench.core process, its JSON rows printed
  local name=$1; shift
  part "core: $name"
  timeout "$(limit 5)" python3 -m oomb.bench.core --out "$W/core_$name.json" "$@" > "$W/core_$name.log" 2>&1
  echo "core exit $?"; grep -E '^\{' "$W/core_$name.log" | cut -c1-260
}
if [[ $PART == a ]]; then
  core dense-chunk8192 --lengths "" --cache-lengths 65536,131072 --chunk 8192
  core sparse-bound --lengths "" --sparse-cache-lengths 131072 --select-score bound
  core sparse-mean --lengths "" --sparse-cache-lengths 131072 --select-score mean
  part "profile: the sparse 128K step with Python stacks (which line queues each pageable copy)"
  timeout "$(limit 5)" python3 -m oomb.bench.offload --dense-lengths "" --sparse-lengths "" --growth-lengths "" \
    --select-blocks 4096 --profile-length 131072 --profile-stacks --out "$W/profile_sparse.json" \
    > "$W/profile_sparse.log" 2>&1
  echo "offload exit $?"; grep -E "profile|idle|from|host CUDA" "$W/profile_sparse.log" | cut -c1-240 | head -40
elif [[ $PART == c ]]; then
  part "GPU: the stream tests on the store before the fix (expected to fail)"
  cp oomb/offload/store.py "$W/store_fixed.py"
  if [ -f .old/store_before_fix.py ]; then
    cp .old/store_before_fix.py oomb/offload/store.py
    timeout 150 python3 -m pytest -m gpu tests/offload/test_offload_streams.py -q -p no:cacheprovider \
      > "$W/streams-before-fix.log" 2>&1
    echo "pytest exit $? (before the fix)"; tail -4 "$W/streams-before-fix.log"
    cp "$W/store_fixed.py" oomb/offload/store.py
  fi
  part "GPU: the stream tests and offload bit-identity, fixed"
  timeout 200 python3 -m pytest -m gpu tests/offload/test_offload_streams.py \
    "tests/engine/test_gpu_bf16.py::test_offload_bit_identical_on_gpu" -q -p no:cacheprovider > "$W/gpu-tests-offload.log" 2>&1
  echo "pytest exit $?"; tail -4 "$W/gpu-tests-offload.log"
  part "offload: sparse 128K pair at one page list per chunk, steady state"
  timeout "$(limit 5)" python3 -m oomb.bench.offload --dense-lengths "" --sparse-lengths 131072 --growth-lengths "" \
    --select-blocks 4096 --out "$W/offload_sparse_pair.json" > "$W/offload_sparse_pair.log" 2>&1
  echo "offload exit $?"; grep -E '^\{' "$W/offload_sparse_pair.log" | cut -c1-300
else
  part "sparse quality study (every phase)"
  timeout "$(limit 5)" python3 -m oomb.bench.sparse_quality --out "$W/sparse_quality" --data-workers 12 \
    --learn-options default,bound > "$W/sparse_quality.log" 2>&1
  echo "sparse_quality exit $?"; tail -6 "$W/sparse_quality.log" | cut -c1-300
  rm -rf "$W/sparse_quality/dense_model"
fi
part "done"
tar czf "$OUT/session9-$PART.tar.gz" -C "$W" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' .
