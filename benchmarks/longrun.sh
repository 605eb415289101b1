#!/usr/bin/env bash
# A long-context run on ONE GPU (about 9 minutes on an H200, one command):
# Qwen2.5-0.5B (built-in preset, random init, no downloads) learns the passkey task through a
# length curriculum 128 -> 1K -> 8K -> 32K tokens (dense attention), then a real run at 128K
# tokens (131072, dense by default), then `oomb eval --retrieval` over lengths x depths (dense).
#
#   bash benchmarks/longrun.sh            # everything under $OUT/longrun (./out/longrun without $OUT)
#   RESUME=1 bash benchmarks/longrun.sh   # the next device call, on the machine still warm: continue
#   (bash benchmarks/h200.sh longrun runs it with the settings of the run docs/eval.md reports)
#
# A run longer than one device call (10 minutes): call again within the machine's warm period with
# RESUME=1 and the same settings (checked against $OUT/longrun/settings.txt). Finished phases are
# skipped; a long phase stopped by the time guard resumes from its checkpoint (one kept,
# train.keep_last=1) and may be given more LONG_STEPS; each call evaluates into eval, eval-2, ...
# (SKIP_EVAL=1: not this call). The weights are deleted only once the long phase has finished.
#
# Why this shape (evidence from runs on a CPU):
# - loss on the answer digits only (data.loss_on=answer): with the loss on all tokens the filler
#   dominates the gradient and a random-init model did not learn retrieval at all in 500 steps;
#   with the answer only it did, within a few hundred steps at 64-256 tokens;
# - start short: at N tokens the answer's gradient through attention to the passkey is ~1/N, so
#   retrieval is found in a few thousand sequences of 64-128 tokens and then carried to longer
#   lengths (each phase starts from the previous phase's export, model.path=<run>/export, with a
#   fresh AdamW and its own warmup); on the CPU a model trained at 256 tokens retrieved at 1K
#   (0.84-0.97) but not reliably at 4K (0.00-0.56) or 16K (0.00);
# - 2 digits by default (exact-match chance 1%): learned ~4x faster than 5 digits on the CPU;
# - dense attention at 128K: page selection scores mean queries of a 128-query block against mean
#   keys of 128-key pages, which dilutes the single QUERY->KEY match, so a sparse step would
#   likely not select the passkey's page and the answer's gradient would not reach it; the eval
#   is dense too, so the long phase trains what is measured. LONG_BUDGET=64 makes the long phase
#   page-sparse (~4x cheaper per step; likely worse retrieval);
# - the lr falls ~5x from the short phases to the long single-sequence ones: on the CPU, 20 steps
#   x 1 sequence at 4x the length at the short phases' lr (fresh AdamW) cut retrieval from 0.84 to
#   0.12-0.16, at a 10x lower lr they raised it to 0.94. Parameters are bf16 on the GPU (the Triton
#   kernels' dtype); before train.master_weights an update below half a bf16 step (~6e-5 for a
#   weight of 0.016) was rounded away, hence not much lower than 1e-4. Now the optimizer steps fp32
#   master copies by default (train.master_weights=auto) and keeps such updates (not yet run here).
#
# H200 time, ESTIMATES made before the first run (not measured for 0.5B then; 7B dense steps of that day
# 16K 2.6 s, 64K 19 s, 128K 60 s; 0.5B has ~15x fewer linear FLOPs and ~4.7x fewer attention FLOPs per token
# and runs less efficiently): ~40-60K tokens/s at short lengths; a dense 128K step ~15-25 s
# (sparse, 64 pages: ~3-5 s); ~20-30 s per `oomb train` for start-up, model build, checkpoint and
# export. Per phase, with the defaults:
#   len128      128 x 64 x 150 steps = 1.2M tokens   ~25-35 s + ~25 s start/save
#   len1024    1024 x 16 x  60 steps = 1.0M tokens   ~20-30 s + ~25 s
#   len8192    8192 x  4 x  30 steps = 1.0M tokens   ~20-30 s + ~25 s
#   len32768  32768 x  1 x  40 steps = 1.3M tokens   ~40-60 s + ~25 s   (dense 32K step ~1-1.5 s)
#   long131072        1 x <=12 steps (dense): what is left of DEADLINE (540 s) after the phases
#                     above and EVAL_RESERVE (120 s), ~150-250 s: ~6-12 steps
#   eval 4k,32k,128k x 3 depths x 4 samples (dense forward, ~2-5 s per 128K sample)  ~45-90 s
#   total ~8.5-9 minutes. Every phase is overridable (env vars below); the summary prints the
#   seconds each phase took and how many steps it ran.
set -euo pipefail

OUT=${OUT:-out}/longrun
PRESET=${PRESET:-qwen2.5-0.5b}
DIGITS=${DIGITS:-2}            # passkey digits; exact-match chance is 10^-DIGITS (0.1 per digit)
TASK=${TASK:-passkey}          # passkey or needle
SEED=${SEED:-0}
# the curriculum (dense): "len:batch:steps:lr[:needles]" per phase, each from the previous phase's export;
# needles (data.needles, TASK=needle only, default 1): key/value needles per sequence, each asked once at the end
CURRICULUM=${CURRICULUM:-"128:64:150:5e-4 1024:16:60:4e-4 8192:4:30:2e-4 32768:1:40:1e-4"}
# the long run (>= 128K), batch 1
LONG_LEN=${LONG_LEN:-131072}; LONG_STEPS=${LONG_STEPS:-12}; LONG_LR=${LONG_LR:-1e-4}  # constant lr after warmup
LONG_NEEDLES=${LONG_NEEDLES:-1}  # needles per long sequence (TASK=needle): retrieval examples per long step
# time guard: the long phase gets at most DEADLINE - (seconds used so far) - EVAL_RESERVE seconds
# (at least LONG_MIN_S); when that runs out it is stopped by SIGTERM at a chunk boundary, saves its
# last completed step (oomb's graceful stop, exit 75) and the eval uses that checkpoint.
DEADLINE=${DEADLINE:-540}; EVAL_RESERVE=${EVAL_RESERVE:-120}; LONG_MIN_S=${LONG_MIN_S:-90}
LONG_BUDGET=${LONG_BUDGET:-}   # empty = dense; a number = page-sparse with that many pages
CHUNK=${CHUNK:-4096}           # chunk size (a phase shorter than it uses its own length as the chunk)
WARMUP=${WARMUP:-10}           # warmup steps of a phase (fresh AdamW each), at most a fifth of its steps
# eval grid (dense forward over every chunk)
EVAL_LENGTHS=${EVAL_LENGTHS:-4k,32k,128k}; EVAL_DEPTHS=${EVAL_DEPTHS:-0.1,0.5,0.9}; EVAL_SAMPLES=${EVAL_SAMPLES:-4}
KEEP_WEIGHTS=${KEEP_WEIGHTS:-0} # 0: delete checkpoints/ and export/ once used (GBs of random-init weights)
# RESUME=1: continue the run already in $OUT (same settings), e.g. in the next device call on a machine
# that is still warm (its files are kept only while it is): phases finished earlier are skipped, and a
# long phase stopped by the time guard resumes from its checkpoint (oomb train resume=...) up to LONG_STEPS.
RESUME=${RESUME:-0}
SKIP_EVAL=${SKIP_EVAL:-0}      # 1: no eval this call (an intermediate call of a run spread over several)
CURRICULUM_ONLY=${CURRICULUM_ONLY:-0}  # 1: stop after the curriculum (RESUME=1 in a later call runs the long phase)
EXTRA=${EXTRA:-}               # extra key=value for every training phase (e.g. train.page_size=64)
EVAL_EXTRA=${EVAL_EXTRA:-}     # extra options for oomb eval (e.g. --page-size 64)

# oomb from this checkout, without pip install (as benchmarks/h200.sh): python3 -m oomb.cli
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls "$ROOT"/.whl/*.whl >/dev/null 2>&1; then  # wheels missing on the machine (liger-kernel), as h200.sh
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$ROOT"/.whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
OOMB=(python3 -m oomb.cli)
if ! python3 -c "import torch, transformers, yaml, rich, matplotlib, psutil, safetensors, oomb.cli" 2>/tmp/longrun_import.err; then
  echo "error: python3 cannot import what oomb train/eval need:" >&2; tail -3 /tmp/longrun_import.err >&2; exit 1
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
  'cuda:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"

SETTINGS="PRESET=$PRESET DIGITS=$DIGITS TASK=$TASK SEED=$SEED CURRICULUM=$CURRICULUM LONG_LEN=$LONG_LEN \
LONG_LR=$LONG_LR LONG_NEEDLES=$LONG_NEEDLES LONG_BUDGET=$LONG_BUDGET CHUNK=$CHUNK WARMUP=$WARMUP EXTRA=$EXTRA"
if [ "$RESUME" = 1 ] && [ -f "$OUT/settings.txt" ]; then
  if [ "$(cat "$OUT/settings.txt")" != "$SETTINGS" ]; then
    echo "error: RESUME=1 with other settings than the run in $OUT was started with:" >&2
    echo "  then: $(cat "$OUT/settings.txt")" >&2; echo "  now:  $SETTINGS" >&2; exit 2
  fi
  echo "resuming the run in $OUT"
elif [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
  echo "error: $OUT already holds files; set OUT=... to another folder (or RESUME=1 to continue its run)" >&2
  exit 2
fi
mkdir -p "$OUT"
if [ ! -f "$OUT/settings.txt" ]; then printf '%s' "$SETTINGS" > "$OUT/settings.txt"; fi
START=$SECONDS
# train.final_eval_samples=0: this script scores the last phase with oomb eval itself, within its time budget
COMMON="data.task=$TASK data.loss_on=answer data.passkey_digits=$DIGITS train.seed=$SEED train.final_eval_samples=0"
FROM="model.preset=$PRESET"
PREV=""
PHASES=""

phase() {  # name len batch steps lr [key=value...]; $LIMIT (seconds, empty = none) caps the phase
  local name=$1 len=$2 batch=$3 steps=$4 lr=$5; shift 5
  local chunk=$CHUNK t0=$SECONDS losses rc=0 run=("${OOMB[@]}" train) log="$OUT/$name.log"
  if [ -f "$OUT/$name.done" ]; then  # RESUME=1: finished in an earlier call
    echo "=== phase $name: finished in an earlier call"
    PHASES+="$(cat "$OUT/$name.done")"$'\n'
    PREV="$OUT/$name"; FROM="model.path=$OUT/$name/export"
    return
  fi
  if [ -n "${LIMIT:-}" ]; then run=(timeout --preserve-status -s TERM -k 180 "$LIMIT" "${OOMB[@]}" train); fi
  if [ "$len" -lt "$chunk" ]; then chunk=$len; fi
  local warmup=$(( steps / 5 < WARMUP ? steps / 5 : WARMUP ))
  lr=$(python3 -c "import sys; print(repr(float(sys.argv[1])))" "$lr")  # 5e-4 -> 0.0005 (YAML reads 5e-4 as text)
  if [ "$RESUME" = 1 ] && [ -d "$OUT/$name" ] && ! ls -d "$OUT/$name"/checkpoints/step-* >/dev/null 2>&1; then
    # an earlier call stopped this phase before its first checkpoint: keep its files aside, start it again
    local aside
    aside="$OUT/$name.incomplete-$(date +%s)"
    echo "=== phase $name: no checkpoint from the earlier call; its folder moves to $aside"
    mv "$OUT/$name" "$aside"
    if [ -f "$log" ]; then mv "$log" "$aside.log"; fi
  fi
  if [ "$RESUME" = 1 ] && ls -d "$OUT/$name"/checkpoints/step-* >/dev/null 2>&1; then
    # stopped by the time guard in an earlier call: continue from its latest checkpoint
    echo "=== phase $name: resuming from its latest checkpoint, up to $steps steps ($(( SECONDS - START )) s so far)"
    if [ -f "$log" ]; then mv "$log" "$OUT/$name.before-$(date +%s).log"; fi
    "${run[@]}" resume="$OUT/$name" train.steps="$steps" > "$log" 2>&1 || rc=$?
  else
    echo "=== phase $name: $len tokens x $batch x $steps steps, lr $lr, from $FROM ($(( SECONDS - START )) s so far)"
    # shellcheck disable=SC2086
    "${run[@]}" $FROM $COMMON data.seq_len="$len" train.batch_size="$batch" train.steps="$steps" \
        train.lr="$lr" train.warmup_steps="$warmup" train.chunk_size="$chunk" out_dir="$OUT/$name" $EXTRA "$@" \
        > "$log" 2>&1 || rc=$?
  fi
  if [ "$rc" = 75 ] && [ -n "${LIMIT:-}" ] && [ -d "$OUT/$name/checkpoints" ] && [ -s "$OUT/$name/metrics.jsonl" ]; then
    echo "phase $name: stopped by the time guard after ${LIMIT} s; its last completed step is saved"
    python3 -c "import sys; from pathlib import Path; from oomb.train.loop.monitor import plot_run; plot_run(Path(sys.argv[1]))" \
      "$OUT/$name" || true  # training.png (an interrupted run does not draw it)
  elif [ "$rc" = 75 ] && [ -n "${LIMIT:-}" ]; then
    echo "error: phase $name: no step finished within the time guard (${LIMIT} s); raise DEADLINE or" \
         "LONG_MIN_S, or shorten CURRICULUM; log: $OUT/$name.log" >&2; exit 1
  elif [ "$rc" != 0 ]; then
    echo "error: phase $name failed (exit $rc); the last lines of $OUT/$name.log:" >&2; tail -30 "$OUT/$name.log" >&2
    exit 1
  fi
  grep -E "^(oomb train|done:)" "$OUT/$name.log" || true
  losses=$(python3 - "$OUT/$name/metrics.jsonl" <<'PY'
import json, sys
r = [x["loss"] for x in map(json.loads, open(sys.argv[1])) if x.get("loss") is not None]
n = max(1, len(r) // 10)
print(f"{sum(r[:n]) / n:.3f} (first {n} steps) -> {sum(r[-n:]) / n:.3f} (last {n})" if r else "none")
PY
)
  local done_steps
  done_steps=$(grep -c '"step"' "$OUT/$name/metrics.jsonl" || true)
  local line="  $name: $len tokens x $batch x $done_steps/$steps steps, lr $lr, $(( SECONDS - t0 )) s: answer loss $losses"
  PHASES+="$line"$'\n'
  if [ "$rc" = 0 ]; then printf '%s' "$line" > "$OUT/$name.done"; fi  # RESUME=1 skips it
  if [ "$KEEP_WEIGHTS" = 0 ] && [ -z "${LIMIT:-}" ]; then  # the next phase starts from this export
    rm -rf "$OUT/$name/checkpoints"
    if [ -n "$PREV" ]; then rm -rf "$PREV/export"; fi
  fi
  PREV="$OUT/$name"
  FROM="model.path=$OUT/$name/export"
}

needles_arg() {  # needles_arg N: the data.needles override for TASK=needle (none for one needle)
  if [ "${1:-1}" != 1 ]; then
    if [ "$TASK" != needle ]; then echo "error: needles need TASK=needle" >&2; exit 2; fi
    echo "data.needles=$1"
  fi
}
for spec in $CURRICULUM; do
  IFS=: read -r len batch steps lr needles <<< "$spec"
  # shellcheck disable=SC2046  # an empty needles_arg adds no word
  phase "len$len" "$len" "$batch" "$steps" "$lr" $(needles_arg "${needles:-1}")
done
if [ "$CURRICULUM_ONLY" = 1 ]; then
  echo; echo "=== summary ($OUT, $(( SECONDS - START )) s in all; curriculum only, RESUME=1 runs the long phase)"
  printf '%s' "$PHASES"; exit 0
fi
LONG_EXTRA=(train.min_lr_ratio=1.0 train.keep_last=1)  # the guard may stop it anywhere: no decay; one checkpoint
if [ "$LONG_NEEDLES" != 1 ]; then LONG_EXTRA+=("$(needles_arg "$LONG_NEEDLES")"); fi
if [ -n "$LONG_BUDGET" ]; then LONG_EXTRA+=(train.page_budget="$LONG_BUDGET"); fi
LIMIT=$(( DEADLINE - SECONDS + START - EVAL_RESERVE ))
if [ "$LIMIT" -lt "$LONG_MIN_S" ]; then LIMIT=$LONG_MIN_S; fi
BASE="$PREV"  # the long run's model.path: kept until the eval has run (a checkpoint eval rebuilds from it)
phase "long$LONG_LEN" "$LONG_LEN" 1 "$LONG_STEPS" "$LONG_LR" ${LONG_EXTRA[@]+"${LONG_EXTRA[@]}"}
LIMIT=""
LONG="$PREV"
EVAL_MODEL="$LONG/export"  # a run stopped by the time guard has no export: its latest checkpoint
if [ ! -f "$EVAL_MODEL/config.json" ]; then EVAL_MODEL="$LONG"; fi

# a long phase that did not finish keeps its checkpoint (and the export it started from) for RESUME=1
cleanup() {
  if [ "$KEEP_WEIGHTS" != 0 ]; then return; fi
  if [ -f "$LONG.done" ]; then rm -rf "$LONG/export" "$LONG/checkpoints" "$BASE/export"
  else echo "  kept $LONG/checkpoints and $BASE/export: the long phase is unfinished (RESUME=1 continues it)"; fi
}
if [ "$SKIP_EVAL" = 1 ]; then
  echo; echo "=== summary ($OUT, $(( SECONDS - START )) s in all; no eval this call)"; printf '%s' "$PHASES"
  cleanup; exit 0
fi
EVAL_DIR="$OUT/eval"; n=1
while [ -e "$EVAL_DIR" ]; do n=$(( n + 1 )); EVAL_DIR="$OUT/eval-$n"; done  # one per call of a resumed run
echo "=== eval: $EVAL_LENGTHS x depths $EVAL_DEPTHS x $EVAL_SAMPLES samples ($(( SECONDS - START )) s so far)"
t0=$SECONDS
# shellcheck disable=SC2086
if ! "${OOMB[@]}" eval "$EVAL_MODEL" --retrieval --task "$TASK" --digits "$DIGITS" --seed "$SEED" \
    --lengths "$EVAL_LENGTHS" --depths "$EVAL_DEPTHS" --samples "$EVAL_SAMPLES" --chunk-size "$CHUNK" \
    --out "$EVAL_DIR" $EVAL_EXTRA > "$EVAL_DIR.log" 2>&1; then
  echo "error: the eval failed; the last lines of $EVAL_DIR.log:" >&2; tail -30 "$EVAL_DIR.log" >&2; exit 1
fi
EVAL_S=$(( SECONDS - t0 ))
cleanup

echo
echo "=== summary ($OUT, $(( SECONDS - START )) s in all; eval of $EVAL_MODEL)"
printf '%s' "$PHASES"
python3 - "$EVAL_DIR/results.json" "$DIGITS" "$EVAL_S" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["retrieval"]
digits = int(sys.argv[2])
print(f"  eval, {sys.argv[3]} s: {r['task']}, {digits} digits; chance {10 ** -digits:g} (whole answer), 0.1 per digit")
by_len = {}
for c in r["cells"]:
    by_len.setdefault(c["length"], []).append(c)
for length, cells in sorted(by_len.items()):
    acc = sum(c["accuracy"] for c in cells) / len(cells)
    tok = sum(c["token_accuracy"] for c in cells) / len(cells)
    per_depth = ", ".join(f"depth {c['depth']:g}: {c['accuracy']:.2f}" for c in cells)
    print(f"  length {length}: accuracy {acc:.2f}, digits {tok:.2f} ({per_depth})")
PY
echo "  files: $LONG/metrics.jsonl, $LONG/training.png, $EVAL_DIR/results.json, $EVAL_DIR/retrieval.png"
