#!/usr/bin/env bash
# Session 7 (2026-12-03) on one H200: issue 6's long run, spread over three device calls.
#   PART=a bash scripts/h200_session7.sh   # GPU tests, then the curriculum, then the 128K phase with the time left
#   PART=b bash scripts/h200_session7.sh   # within the machine's warm period: the 128K phase continues
#   PART=c bash scripts/h200_session7.sh   # the 128K phase to a step count that fits, then the eval
#   PART=d bash scripts/h200_session7.sh   # all of it in one call, with a shorter curriculum (part a's
#                                            machine was not warm any more for part b)
# The run lives in $W/longrun (kept on the machine while it is warm); each part sends back its logs,
# metrics, plots and eval (no weights) as $OUT/session7-$PART.tar.gz.
#
# The recipe (scripts/h200_longrun.sh; why in docs/LOG.md, sessions 3-6): Qwen2.5-0.5B preset, random
# init, passkey with ONE digit (chance 0.1: the sparse quality study's model learned it to 100% at 32K),
# loss on the answer only, dense attention; curriculum 128 -> 1K -> 8K -> 32K, then 131072 tokens.
set -uo pipefail
DEFAULT_BUDGET=560
# shellcheck source=scripts/h200_env.sh
source "$(dirname "$0")/h200_env.sh"
require_part a b c d
record_machine

export OUT_RUN=$W DIGITS=1 LONG_LEN=131072 LONG_LR=1e-4 CHUNK=4096 KEEP_WEIGHTS=0
export CURRICULUM=${CURRICULUM:-"128:64:250:5e-4 1024:16:100:4e-4 8192:4:40:2e-4 32768:1:100:1e-4"}
export EVAL_LENGTHS=4k,32k,128k EVAL_DEPTHS=0.1,0.5,0.9 EVAL_SAMPLES=8
LONG_STEPS_MAX=400  # parts a and b: the time guard ends the phase long before
SAVE_S=45           # after the guard's SIGTERM: the step in flight, the checkpoint (~6 GB with AdamW), exit
longrun() { OUT=$OUT_RUN bash scripts/h200_longrun.sh; }
# long_phase T: resume the run into its 128K phase for T seconds (the guard then saves it), no eval
long_phase() { RESUME=1 SKIP_EVAL=1 LONG_STEPS=$LONG_STEPS_MAX DEADLINE=$1 EVAL_RESERVE=0 LONG_MIN_S=$1 longrun; }

if [[ $PART == a ]]; then
  part "GPU tests (kernels in bf16, host syncs per step, offload bit-identity)"
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests > "$W/gpu_tests.log" 2>&1
  echo "tests exit $?"; grep -E "passed|failed|Error" "$W/gpu_tests.log" | tail -8

  part "long run: the curriculum"
  CURRICULUM_ONLY=1 longrun
  t=$(limit $SAVE_S)
  if [ "$t" -ge 120 ]; then
    part "long run: the 128K phase, $t s"
    long_phase "$t"
  fi
elif [[ $PART == b ]]; then
  t=$(limit $SAVE_S)
  part "long run: the 128K phase continues, $t s"
  long_phase "$t"
elif [[ $PART == c ]]; then
  EVAL_S=${EVAL_S:-160}  # the eval: 8 samples x 3 depths at 128K (~4-5 s each) plus the shorter lengths
  t=$(limit $(( EVAL_S + SAVE_S )))
  # a step count that ends within t (so the phase finishes: its export, plot and .done), from the
  # median seconds per step so far; 60 s for start-up, checkpoint load and the final save and export
  steps=$(python3 - "$W/longrun/long$LONG_LEN/metrics.jsonl" "$t" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [r for r in rows if r.get("loss") is not None]
per_step = statistics.median(r["seconds"] for r in steps)
print(steps[-1]["step"] + max(1, int((int(sys.argv[2]) - 60) / per_step)))
PY
)
  part "long run: the 128K phase to step $steps ($t s), then the eval"
  RESUME=1 LONG_STEPS=$steps DEADLINE=$(( t + EVAL_S )) EVAL_RESERVE=$EVAL_S LONG_MIN_S=$t longrun
elif [[ $PART == d ]]; then
  # part a (2026-12-03): 1 digit was learned to loss 0 by step ~97 at 128 tokens, 1K and 8K started at
  # loss 0, 32K (100 x 1) was 0 on most steps: shorter phases, 16K instead of 8K + 32K (8x jumps
  # worked), then the 128K phase with what the call leaves after the eval's reserve
  part "long run in one call"
  CURRICULUM="128:64:160:5e-4 1024:16:30:4e-4 16384:2:30:2e-4" EVAL_SAMPLES=6 LONG_STEPS=$LONG_STEPS_MAX \
    DEADLINE=$(( $(left) - 10 )) EVAL_RESERVE=150 LONG_MIN_S=120 longrun
fi
part "done"
tar czf "$OUT/session7-$PART.tar.gz" -C "$W" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
  --exclude=checkpoints --exclude=export .
