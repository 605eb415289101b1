#!/usr/bin/env bash
# Issue 6's long-context run on one GPU: Qwen2.5-0.5B (built-in preset, random init) learns the
# passkey task at 4K tokens, continues at 128K with page-sparse attention, then is evaluated
# over lengths x depths. Everything under $OUT/longrun (or ./out/longrun).
#   bash scripts/h200_longrun.sh            # SHORT_STEPS, LONG_STEPS, LR, BUDGET overridable
# The short phase exists because a random-init model needs on the order of N sequences to find
# a passkey N tokens back (docs/LOG.md, 2026-12-02); 128K is then reached from a model that
# already retrieves at 4K.
set -euo pipefail
OUT=${OUT:-out}/longrun; mkdir -p "$OUT"
SHORT_STEPS=${SHORT_STEPS:-400}; LONG_STEPS=${LONG_STEPS:-30}; LR=${LR:-3e-4}; BUDGET=${BUDGET:-64}
COMMON="model.preset=qwen2.5-0.5b data.task=passkey data.loss_on=answer train.warmup_steps=20"
oomb train $COMMON data.seq_len=4096 train.batch_size=8 train.steps=$SHORT_STEPS train.lr=$LR \
  train.chunk_size=4096 out_dir="$OUT/short" 2>&1 | tail -5 | tee "$OUT/short.log"
oomb train $COMMON model.path="$OUT/short/export" data.seq_len=131072 train.steps=$LONG_STEPS \
  train.lr=$LR train.page_budget=$BUDGET train.save_every=10 train.tensorboard=true \
  out_dir="$OUT/long" 2>&1 | tail -5 | tee "$OUT/long.log"
oomb eval "$OUT/long" --retrieval --lengths 4k,16k,64k,128k --depths 0.1,0.3,0.5,0.7,0.9 --samples 4 \
  --out "$OUT/eval" 2>&1 | tail -20 | tee "$OUT/eval.log"
