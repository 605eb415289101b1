#!/usr/bin/env bash
# Reproduces every measured figure of README.md and docs/ on one NVIDIA H200 (139.8 GiB; 125.8 GiB host
# memory), from the repo root. One job per record of benchmarks/results/: a job writes $OUT/NAME.json under
# the record's own name (compare it with benchmarks/results/NAME.json), its log as $OUT/NAME.log.
#
#   bash benchmarks/h200.sh PART|JOB ...        # e.g. core sparse offload faults longrun quality gpu-tests
#   bash benchmarks/h200.sh all                 # every part, in the order below (about 3 hours)
#   bash benchmarks/h200.sh --list              # the parts and their jobs
#   bash benchmarks/h200.sh --dry-run PART ...  # print the commands, run nothing
#
# OUT: the folder for results (default ./out). TIMEOUT: seconds allowed per job (default: none). Wheels the
# machine lacks (liger-kernel: it has no network) are installed from .whl/*.whl into /tmp/site first.
# Each job pins the options whose defaults changed since its record was made (fused ops, the page score),
# so it measures what the record measured with the code of today. benchmarks/README.md lists what each
# job measures; a part that needs more than a 10-minute device call is split by naming its jobs.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-out}

declare -A JOB PART
JOBS=()
PARTS=()
job() { JOB[$1]=$2; JOBS+=("$1"); }
part() { PART[$1]=$2; PARTS+=("$1"); }

C='python3 -m benchmarks.core'
O='python3 -m benchmarks.offload'
NOSPLIT='--dense-lengths "" --sparse-lengths "" --growth-lengths ""'
# benchmarks.offload swaps in liger's fused ops as `oomb train` does; the jobs whose records were measured with
# transformers' modules keep them, so they reproduce those records (and compare with them).
PLAIN='--fused-ops none'
# Weight gradients are added into .grad by their matmuls where fused ops are on (train.fused_grad_accumulation);
# the jobs whose records were measured with autograd's add keep it.
G0='--grad-accumulation plain'

# gpu-tests: every GPU test (GPU_TESTS="tests/a.py tests/b.py ..." runs those only, with the wheels' path set up);
# the gradient errors of bf16 training against fp32 that they print.
job gpu-tests 'python3 -m pytest -q -rfE -m gpu -p no:cacheprovider ${GPU_TESTS:-tests}'
job gradient-accuracy-bf16 'python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/engine/test_gpu_bf16.py \
    > "$OUT/gradient-accuracy-bf16.pytest.log" 2>&1
  python3 -m benchmarks.records gradient-accuracy "$OUT/gradient-accuracy-bf16.pytest.log" \
    --command "python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/engine/test_gpu_bf16.py" \
    --out "$OUT/gradient-accuracy-bf16.json"'
part gpu-tests 'gpu-tests gradient-accuracy-bf16'

# core: one training step of Qwen2.5-7B against context length, and transformers' step beside it.
job core-7b-chunk4096 "$C --lengths 32768,65536,131072 --cache-lengths 65536,131072 --sparse-lengths 131072 \
  --sparse-cache-lengths 131072 --hf-lengths 65536,131072 --fused-ops none --select-score mean"
job core-7b-fused-ops "$C $G0 --lengths '' --cache-lengths 65536,131072 --sparse-cache-lengths 131072 --fused-ops auto \
  --tiles default --select-score mean"
job core-7b-no-fused-ops "$C --lengths '' --cache-lengths 65536 --fused-ops none"
# The baseline a user would pick (transformers + FlashAttention-4 or SDPA + Liger + checkpointing, each in
# its own process) beside what `oomb train` picks by itself and oomb's fastest settings; FA4 needs its wheels.
job core-7b-vs-transformers-64k "$C $G0 --lengths '' --cache-lengths 65536 --auto-lengths 65536 --baseline-lengths 65536 \
  --baseline-stacks fa4 --chunk 8192 --fused-ops auto --warm-each --repeats 2 --backend fa4"
job core-7b-vs-transformers-128k "$C $G0 --lengths '' --baseline-lengths 131072 --cache-lengths 131072 --chunk 8192 \
  --fused-ops auto --warm-each --repeats 2 --backend fa4"
# Stage 2 one layer at a time (train.recompute): every layer's input kept in host memory, beside the whole-chunk
# recompute, with the attention cache on the GPU and in host memory, against the baseline stacks; one more step of
# each row under the profiler (where a 64K step's GPU time goes).
job core-7b-recompute-64k "$C $G0 --lengths '' --cache-lengths 65536 --cache-host-lengths 65536 --baseline-lengths 65536 \
  --chunk 8192 --recompute chunk,layer-host --fused-ops auto --warm-each --repeats 2 --backend fa4 --profile-lengths 65536"
# The same at 128K with chunks of 16384 (layer-host only: whole-chunk recompute of 16384 tokens does not fit with
# the cache); FA4's stack only (SDPA's is slower, and both do not fit one 10-minute device call with oomb's rows).
job core-7b-recompute-128k "$C $G0 --lengths '' --cache-lengths 131072 --cache-host-lengths 131072 --baseline-lengths 131072 \
  --baseline-stacks fa4 --chunk 16384 --recompute layer-host --fused-ops auto --warm-each --repeats 2 --backend fa4"
# 256K: the FA4 stack's step (about 2 minutes) and oomb's do not fit one 10-minute device call together: the
# stack in one job, then what `oomb train` picks (layer-host, chunks of 16384, the cache in host memory) against it.
job core-7b-vs-transformers-256k-baseline "$C $G0 --lengths '' --baseline-lengths 262144 --baseline-stacks fa4 --warm-each \
  --repeats 2"
job core-7b-vs-transformers-256k "$C $G0 --lengths '' --auto-lengths 262144 \
  --baseline-from \"\$OUT/core-7b-vs-transformers-256k-baseline.json\" --fused-ops auto --warm-each --repeats 2 --backend fa4"
# The lean setting: no attention cache, short chunks (less memory than the baseline).
job core-7b-lean-64k "$C $G0 --lengths 65536 --baseline-lengths 65536 --chunk 2048 --fused-ops auto --warm-each --repeats 2 \
  --backend fa4"
# Page-sparse attention at 128K beside the baseline (and the dense step with the Triton kernels).
job core-7b-sparse-vs-transformers-128k "$C $G0 --lengths '' --baseline-lengths 131072 --cache-lengths 131072 \
  --sparse-cache-lengths 131072 --chunk 8192 --fused-ops auto --warm-each --repeats 2 --backend triton"
# What `oomb train` picks by itself and the step time it reports (optimizer step included), killed after
# the steps are logged (no 45 GB final checkpoint).
job train-7b-auto 'python3 -m benchmarks.train_steps --lengths 65536,131072 --steps 3,3 --timeout 150 \
  --keys train.fused_grad_accumulation=false \
  --out "$OUT/train-7b-auto.json"'
part core 'train-7b-auto core-7b-recompute-64k core-7b-recompute-128k core-7b-vs-transformers-256k-baseline
  core-7b-vs-transformers-256k core-7b-chunk4096 core-7b-fused-ops core-7b-no-fused-ops core-7b-vs-transformers-64k
  core-7b-vs-transformers-128k core-7b-lean-64k core-7b-sparse-vs-transformers-128k'

# qlora: `oomb train` with bf16 LoRA against QLoRA (NF4 base) on Qwen2.5-7B at 128K, adapters on every linear layer,
# each in its own process, the rest as oomb train picks it: step time and peak GPU memory. Needs peft and
# bitsandbytes (wheels in .whl/ where the machine lacks them); a variant that cannot start is recorded as failed.
job train-7b-qlora-vs-lora-128k 'python3 -m benchmarks.train_steps --lengths 131072 --steps 3 --timeout 270 \
  --variant lora "lora.r=16 lora.targets=all-linear" \
  --variant qlora "lora.r=16 lora.targets=all-linear model.quantize=nf4" --out "$OUT/train-7b-qlora-vs-lora-128k.json"'
part qlora 'train-7b-qlora-vs-lora-128k'

# models: presets other than Qwen2.5-7B under `oomb train`, in the settings its memory plan picks.
job train-gpt-oss-20b-lora 'python3 -m benchmarks.train_steps --preset gpt-oss-20b --lengths 65536,131072 \
  --steps 2,2 --timeout 150 --keys "lora.r=16 lora.targets=all-linear" --out "$OUT/train-gpt-oss-20b-lora.json"'
# GPT-OSS-20B against the FA4 stack at 64K, attention weights trained (its bf16 weights and gradients do not fit
# otherwise); oomb in its lean setting (layer-host, chunks of 16384, the cache in host memory). Run on an H100.
job core-gpt-oss-20b-vs-transformers-64k "$C --preset gpt-oss-20b --trainable attention --lengths '' \
  --cache-host-lengths 65536 --baseline-lengths 65536 --baseline-stacks fa4 --chunk 16384 --recompute layer-host \
  --warm-each --repeats 2 --backend fa4"
# Each preset against the FA4 stack at 64K, all weights trained, no optimizer (a full fine-tune's AdamW states do
# not fit an 80 GB card beside an 8B model at 64K: `oomb plan` says so): layer-host, chunks of 16384, the attention
# cache on the GPU (the fast setting, what `oomb train` picks for Qwen2.5-7B) and in host memory (the lean one).
# Run on an H100.
VS64='--lengths "" --cache-lengths 65536 --cache-host-lengths 65536 --baseline-lengths 65536 --baseline-stacks fa4 \
  --chunk 16384 --recompute layer-host --warm-each --repeats 2 --backend fa4'
# At 128K the stack runs out of memory on an 80 GB card for these models (Llama-3-8B did, 2026-12-06): its row
# records that, and oomb's lean row the step time and memory.
VS128='--lengths "" --cache-host-lengths 131072 --baseline-lengths 131072 --baseline-stacks fa4 --chunk 16384 \
  --recompute layer-host --warm-each --repeats 2 --backend fa4'
for preset in llama-3-8b qwen3-8b granite-3.3-8b; do
  job "core-$preset-vs-transformers-64k" "$C --preset $preset $VS64"
  job "core-$preset-vs-transformers-128k" "$C --preset $preset $VS128"
done
# Gemma-3-12B with LoRA r=16 on every linear layer on both sides: its weights and their bf16 gradients (2 x 22 GiB)
# beside its paged store (48 layers of 8 KV heads of 256: 768 KiB a token, 48 GiB at 64K) do not fit 80 GB.
job core-gemma-3-12b-vs-transformers-64k "$C --preset gemma-3-12b --trainable lora --auto-lengths 65536 $VS64"
# LoRA, the mode `oomb train` fits on an 80 GB card for the 8B models at 64K: what it picks against the stack with
# peft's LoRA.
for preset in llama-3-8b qwen3-8b granite-3.3-8b; do
  job "core-$preset-lora-auto-64k" "$C --preset $preset --trainable lora --lengths '' --auto-lengths 65536 \
    --baseline-lengths 65536 --baseline-stacks fa4 --warm-each --repeats 2 --backend fa4"
done
job core-gemma-3-12b-vs-transformers-128k "$C --preset gemma-3-12b --trainable lora $VS128"
# Each preset under `oomb train` in its sensible mode on an 80 GB card (LoRA r=16 on every linear layer: an 8B
# model's full fine-tune with AdamW does not fit beside 64K tokens), at 64K and 128K, then the longest length its
# memory plan allows (one step: the plan's peak prediction checked where it is tightest); each record has the
# plan's GPU peak over the measured one. Qwen2.5-7B's full fine-tune: train-7b-auto.
for preset in llama-3-8b qwen3-8b granite-3.3-8b gemma-3-12b gpt-oss-20b; do
  job "train-$preset-lora-64k-128k" "python3 -m benchmarks.train_steps --preset $preset --lengths 65536,131072 \
    --steps 2,2 --timeout 200 --keys 'lora.r=16 lora.targets=all-linear'"
  job "train-$preset-lora-longest" "python3 -m benchmarks.train_steps --preset $preset --lengths '' --steps '' \
    --longest --timeout 540 --keys 'lora.r=16 lora.targets=all-linear'"
done
part presets "$(for p in llama-3-8b qwen3-8b granite-3.3-8b gemma-3-12b gpt-oss-20b; do
  printf 'train-%s-lora-64k-128k train-%s-lora-longest ' "$p" "$p"; done)"
# unsloth: Unsloth beside oomb, QLoRA r=32 on every linear layer of a random-init Llama-3-8B: Unsloth as
# its docs run it (benchmarks.unsloth_step; its wheels from .unsloth/carry, dev/unsloth-device.md, on a path of
# their own without flash-attn-4), and `oomb train` with the same adapters, 4-bit base and 8-bit AdamW. Each about
# 8 minutes; the longest searches in calls of their own (the docstrings say how to go on).
U='PYTHONPATH=$PWD:/tmp/unsloth_site python3 -m benchmarks.unsloth_step'
job unsloth-llama-3-8b "$U --lengths 16384,65536 --out \"\$OUT/unsloth-llama-3-8b.json\""
job unsloth-llama-3-8b-128k "$U --lengths 131072 --out \"\$OUT/unsloth-llama-3-8b-128k.json\""
job unsloth-llama-3-8b-longest "$U --longest --known-fits 131072 --resolution 32768 --budget-s 540 --work-dir \"\$OUT/longest\" \\
  --out \"\$OUT/unsloth-llama-3-8b-longest.json\""
QLORA32='model.quantize=nf4 lora.r=32 lora.alpha=32 lora.targets=all-linear train.optimizer=adamw8bit'
job train-llama-3-8b-qlora-r32 "python3 -m benchmarks.train_steps --preset llama-3-8b --lengths 16384,65536 \
  --steps 2,2 --timeout 190 --keys '$QLORA32'"
job train-llama-3-8b-qlora-r32-128k "python3 -m benchmarks.train_steps --preset llama-3-8b --lengths 131072 \
  --steps 2 --timeout 300 --keys '$QLORA32'"
# oomb held to Unsloth's footprint at 64K (its 22.64 GiB allocated, 2026-12-07, plus the plan's 1 GiB for the CUDA
# context): the settings its plan fits in that budget (offload and recompute=layer-host: at 64K chunks of 16384, 20
# of 32 layers' pages on the GPU), and with whole-chunk recompute as auto picked it before (chunks of 2048): the
# check of auto's order with offload (docs/memory.md).
job train-llama-3-8b-qlora-r32-unsloth-memory "python3 -m benchmarks.train_steps --preset llama-3-8b --lengths 16384,65536 \
  --steps 2,2 --timeout 150 --keys '$QLORA32 train.offload=true train.gpu_memory=23.6GiB' --variant auto '' \
  --variant chunk 'train.recompute=chunk'"
# ... and at 128K held to Unsloth's 39.44 GiB there (2026-12-08) plus the plan's 1 GiB for the CUDA context.
job train-llama-3-8b-qlora-r32-unsloth-memory-128k "python3 -m benchmarks.train_steps --preset llama-3-8b --lengths 131072 \
  --steps 2 --timeout 300 --keys '$QLORA32 train.offload=true train.gpu_memory=40.4GiB'"
# The plan under-counted the 16K step held to Unsloth's footprint (all 32 layers' pages on the GPU, the attention
# cache and the layer inputs in host memory, one chunk: 14.11 GiB planned, 15.00 allocated), where the same step with
# the cache on the GPU was over-counted (18.04 against 17.50): which part brings the difference, one variant each;
# each row's chunk lines (train.log_chunks) hold the peak at stage 2's start, i.e. stage 1's, and its memory_peak
# (train.memory_snapshot=2) the tensors alive at the peak by the code that made them, beside the plan's items.
job train-llama-3-8b-qlora-r32-16k-peaks "python3 -m benchmarks.train_steps --preset llama-3-8b --lengths 16384 \
  --steps 2 --timeout 140 --keys '$QLORA32 train.chunk_size=16384 train.recompute=layer-host train.log_chunks=true \
  train.memory_snapshot=2' \
  --variant cache-gpu 'train.cache_attention=true' --variant cache-host 'train.cache_attention=host' \
  --variant no-cache 'train.cache_attention=false' --variant offload-cache-host 'train.offload=true train.cache_attention=host' \
  --variant offload-no-cache 'train.offload=true train.cache_attention=false'"
# The two systems side by side at the lengths both ran, from the records of the jobs above made on one machine: in
# the same call, or anywhere after with those records put in $OUT (they read no GPU).
job versus-unsloth-llama-3-8b 'python3 -m benchmarks.records versus-unsloth "$OUT/unsloth-llama-3-8b.json" \
  --oomb "$OUT/train-llama-3-8b-qlora-r32.json" --out "$OUT/versus-unsloth-llama-3-8b.json" \
  --command "bash benchmarks/h200.sh unsloth-llama-3-8b train-llama-3-8b-qlora-r32 versus-unsloth-llama-3-8b"'
# ... and with oomb held to Unsloth's footprint (the two oomb records' rows one after the other).
job versus-unsloth-llama-3-8b-same-memory 'python3 -m benchmarks.records versus-unsloth "$OUT/unsloth-llama-3-8b.json" \
  --oomb "$OUT/train-llama-3-8b-qlora-r32.json" --oomb "$OUT/train-llama-3-8b-qlora-r32-unsloth-memory.json" \
  --out "$OUT/versus-unsloth-llama-3-8b-same-memory.json" --command "bash benchmarks/h200.sh unsloth-llama-3-8b \
  train-llama-3-8b-qlora-r32 train-llama-3-8b-qlora-r32-unsloth-memory versus-unsloth-llama-3-8b-same-memory"'
# ... and at 128K (its own records: the 64K and 128K runs need a device call each).
job versus-unsloth-llama-3-8b-128k 'python3 -m benchmarks.records versus-unsloth "$OUT/unsloth-llama-3-8b-128k.json" \
  --oomb "$OUT/train-llama-3-8b-qlora-r32-128k.json" --out "$OUT/versus-unsloth-llama-3-8b-128k.json" \
  --command "bash benchmarks/h200.sh unsloth-llama-3-8b-128k train-llama-3-8b-qlora-r32-128k versus-unsloth-llama-3-8b-128k"'
# ... and at 128K with oomb held to Unsloth's footprint there (the same machine and day as Unsloth's 128K record).
job versus-unsloth-llama-3-8b-128k-same-memory 'python3 -m benchmarks.records versus-unsloth "$OUT/unsloth-llama-3-8b-128k.json" \
  --oomb "$OUT/train-llama-3-8b-qlora-r32-128k.json" --oomb "$OUT/train-llama-3-8b-qlora-r32-unsloth-memory-128k.json" \
  --out "$OUT/versus-unsloth-llama-3-8b-128k-same-memory.json" --command "bash benchmarks/h200.sh unsloth-llama-3-8b-128k \
  train-llama-3-8b-qlora-r32-128k train-llama-3-8b-qlora-r32-unsloth-memory-128k versus-unsloth-llama-3-8b-128k-same-memory"'
job train-llama-3-8b-qlora-r32-longest "python3 -m benchmarks.train_steps --preset llama-3-8b --lengths '' --steps '' \
  --longest --timeout 540 --keys '$QLORA32'"
part unsloth 'unsloth-llama-3-8b unsloth-llama-3-8b-128k unsloth-llama-3-8b-longest train-llama-3-8b-qlora-r32
  versus-unsloth-llama-3-8b train-llama-3-8b-qlora-r32-unsloth-memory versus-unsloth-llama-3-8b-same-memory
  train-llama-3-8b-qlora-r32-16k-peaks
  train-llama-3-8b-qlora-r32-128k versus-unsloth-llama-3-8b-128k train-llama-3-8b-qlora-r32-unsloth-memory-128k
  versus-unsloth-llama-3-8b-128k-same-memory
  train-llama-3-8b-qlora-r32-longest'
# LoRA r=16 on every linear layer of Llama-3-8B at 64K in the lean setting, oomb's fused LoRA layers (with the
# stack running peft's own beside) and peft's own layers, each in its own process; the full-gradient step in the
# same setting is the lean row of core-llama-3-8b-vs-transformers-64k.
LORA64='--preset llama-3-8b --lengths "" --cache-host-lengths 65536 --chunk 16384 --recompute layer-host \
  --warm-each --repeats 2 --backend fa4'
job core-llama-3-8b-lora-64k "$C $LORA64 --trainable lora --baseline-lengths 65536 --baseline-stacks fa4"
# Where the adapter step's time goes against the full-gradient step's (LoRA saves the frozen weights' gradient
# matmuls, a quarter of the linear layers' work, but measured 0.94x the full step, not 0.9x): both in the setting
# oomb train picks for LoRA (chunks of 16384, the cache on the GPU, layer-host), one step of each under the profiler.
for trained in lora all; do
  job "core-llama-3-8b-$trained-profile-64k" "$C --preset llama-3-8b --trainable $trained --lengths '' \
    --cache-lengths 65536 --chunk 16384 --recompute layer-host --warm-each --repeats 2 --backend fa4 \
    --profile-lengths 65536"
done
# The leanest exact setting: the pages (offload), every layer's input (layer-host) and the attention cache in host
# memory, one layer's activations on the GPU (what `oomb train` picks with offload where the host holds them), all
# weights trained, against the stack.
for preset in llama-3-8b qwen3-8b granite-3.3-8b; do
  job "core-$preset-offload-cached-64k" "$C --preset $preset --lengths '' --offload-cache-host-lengths 65536 \
    --baseline-lengths 65536 --baseline-stacks fa4 --chunk 16384 --recompute layer-host --warm-each --repeats 2 --backend fa4"
done
job core-llama-3-8b-lora-unfused-64k "$C $LORA64 --trainable lora-unfused"
# A sliding layer's attention and page traffic against a full layer's, at 32K and 128K: one profiled step at each
# with the pages and the attention cache in host memory (the record's profile.ranges: each kind's attention kernels,
# by oomb's profiler ranges; pages_moved: each kind's copies). Gemma-3-12B (40 layers of 1024-token windows, 8 full)
# with LoRA, GPT-OSS-20B (12 layers of 128-token windows, 12 full) with its attention weights trained.
for m in "gemma-3-12b lora" "gpt-oss-20b attention"; do
  read -r model trained <<< "$m"
  job "core-$model-windows-profile" "$C --preset $model --trainable $trained --lengths '' --offload-cache-host-lengths 32768,131072 \
    --chunk 16384 --recompute layer-host --warm-each --repeats 1 --backend fa4 --profile-lengths 32768,131072"
done
# packed: tokens per second on packed chat data at 4K, 16K and 32K, `oomb train` (its own settings, AdamW) against
# the FA4 stack (packed by position_ids, fused AdamW) and Unsloth (its padding-free packing on the same sequences,
# fused AdamW), full fine-tune and LoRA r=16 of Qwen2.5-7B; a job per length and variant. Unsloth's packages come
# from .unsloth/carry (carry it in the call, after a call that carried .whl: the two do not fit one call).
for n in 4096 16384 32768; do
  for v in full lora; do
    job "packed-7b-$((n / 1024))k-$v" "python3 -m benchmarks.packed --preset qwen2.5-7b --lengths $n --variants $v \
      --one-chunk --unsloth"
  done
done
part packed "$(for k in 4 16 32; do printf 'packed-7b-%sk-full packed-7b-%sk-lora ' $k $k; done)"
# The same with the attention cache on the GPU (the fast setting), in chunks of 16384 and in one chunk of 64K (with
# layer-host a chunk's activations are one layer's: fewer, longer expert matmuls), every row and the stack's
# profiled: where the step's time goes against the stack's. Run on an H100.
job core-gpt-oss-20b-fast-64k "$C --preset gpt-oss-20b --trainable attention --lengths '' --cache-lengths 65536 \
  --baseline-lengths 65536 --baseline-stacks fa4 --chunk 16384,65536 --recompute layer-host --warm-each \
  --repeats 2 --backend fa4 --profile-lengths 65536"
# GPT-OSS-20B at 128K as the seed trains it: dense (lean) against page-sparse in its
# full-attention layers at `oomb train`'s selection (64 pages a block, a chunk's blocks among 64; its sliding layers
# keep their window), attention weights trained; the stack's row records whether it fits.
job core-gpt-oss-20b-sparse-128k "$C --preset gpt-oss-20b --trainable attention --lengths '' \
  --cache-host-lengths 131072 --sparse-lengths 131072 --budget 64 --chunk-pages 64 --baseline-lengths 131072 \
  --baseline-stacks fa4 --chunk 16384 --recompute layer-host --warm-each --repeats 2 --backend fa4"
# GPT-OSS-20B under `oomb train` as the seed trains it at 512K: page-sparse full-attention layers (64 pages a block),
# sliding layers over their window's pages only, LoRA on every linear layer and the experts; its plan fits an 80 GB
# card without offload (the sliding layers keep one page a chunk). Two steps, the plan's peak beside the measured.
job train-gpt-oss-20b-lora-sparse-512k "python3 -m benchmarks.train_steps --preset gpt-oss-20b --lengths 524288 \
  --steps 2 --timeout 540 --keys 'lora.r=16 lora.targets=all-linear train.page_budget=64'"
part models 'train-gpt-oss-20b-lora train-gpt-oss-20b-lora-sparse-512k core-gpt-oss-20b-vs-transformers-64k core-gpt-oss-20b-fast-64k
  core-gpt-oss-20b-sparse-128k core-llama-3-8b-vs-transformers-64k core-llama-3-8b-lora-64k
  core-llama-3-8b-lora-unfused-64k core-llama-3-8b-offload-cached-64k core-qwen3-8b-offload-cached-64k
  core-granite-3.3-8b-offload-cached-64k core-llama-3-8b-lora-profile-64k
  core-llama-3-8b-all-profile-64k core-qwen3-8b-vs-transformers-64k core-granite-3.3-8b-vs-transformers-64k
  core-gemma-3-12b-vs-transformers-64k core-llama-3-8b-vs-transformers-128k core-qwen3-8b-vs-transformers-128k
  core-granite-3.3-8b-vs-transformers-128k core-gemma-3-12b-vs-transformers-128k core-llama-3-8b-lora-auto-64k
  core-qwen3-8b-lora-auto-64k core-granite-3.3-8b-lora-auto-64k core-gemma-3-12b-windows-profile
  core-gpt-oss-20b-windows-profile'

# memory: GPU memory against context, 16K to 256K (where transformers runs out).
job core-7b-memory "$C --lengths 16384,32768,65536,131072 --ckpt-lengths 65536 --hf-lengths 16384,32768 --fused-ops none"
job core-7b-256k "$C --lengths 16384,262144 --hf-lengths 65536,262144 --fused-ops none"
part memory 'core-7b-memory core-7b-256k'

# attention: the paged attention kernels against SDPA, and tile sweeps.
job attention-kernels 'python3 -m benchmarks.attention --contexts 16384,65536,131072'
job attention-tiles-64k 'python3 -m benchmarks.tune_attention --kv-len 65536 \
  --candidates default,dq-fused,dq-fused-m32,dq-fused-m32-4st,dq-fused-2st'
job attention-tiles-16k 'python3 -m benchmarks.tune_attention --kv-len 16384 \
  --candidates default,fwd-n64,fwd-2st,fwd-4st,fwd-m64-w4'
job attention-dkdv-layouts-64k 'python3 -m benchmarks.tune_attention --kv-len 65536 \
  --candidates default,interleaved-m32,head-major-m32,head-major-m64-4st,head-major-m64-2st'
# The fa4 backend over the pages against FlashAttention-4 on contiguous K/V (needs the flash-attn-4 wheels).
job attention-fa4 'python3 -m benchmarks.attention --contexts 65536,131072 --fa4'
# A sliding layer's attention costs its window, not the past: oomb's kernels (Triton and fa4) at 16K-128K of past with
# and without a 1024-token window (Gemma-3's), Qwen2.5-7B's heads.
job attention-windows 'python3 -m benchmarks.attention --contexts 16384,65536,131072 --window 1024 --fa4'
part attention 'attention-fa4 attention-kernels attention-tiles-64k attention-tiles-16k attention-dkdv-layouts-64k attention-windows'

# sparse: page-sparse attention against dense, kernels and steps, and where a sparse step's time goes.
job sparse-kernels "python3 -m benchmarks.sparse --contexts 65536,131072,262144 --lengths ''"
job sparse-steps-7b 'python3 -m benchmarks.sparse --contexts 65536,131072,262144 --lengths 65536,131072 \
  --sparse-lengths 262144,524288'
job core-7b-sparse-128k-bound "$C $G0 --lengths '' --sparse-cache-lengths 131072 --select-score bound --fused-ops auto"
# The sparse 128K step as `oomb train` runs it (layer-host, the cache, liger's RoPE; page-sparse calls on FA4's block
# sparsity, the default on Hopper) against its floor (about 15.3 s) and target (16.5 s); one profiled
# step per row says where the rest goes. Chunks of 8192 and 16384: a query attends its 64 pages and, causally, its
# own chunk (4096 keys on average with chunks of 8192, 8192 with 16384). About 4 minutes.
job core-7b-sparse-128k-fa4-blocks "$C $G0 --lengths '' --sparse-cache-lengths 131072 --chunk 8192,16384 --recompute layer-host \
  --fused-ops auto --warm-each --repeats 2 --backend fa4 --profile-lengths 131072"
# The same step (chunks of 8192) with blocks choosing among every past page and among 64 (the budget) pages a chunk
# (train.chunk_pages): what FA4 gathers and scatters per call shrinks from the whole past to the cap. Target:
# <= 16.5 s; each row profiled. About 4 minutes.
job core-7b-sparse-128k-caps "$C --lengths '' --sparse-cache-lengths 131072 --chunk 8192 --recompute layer-host \
  --fused-ops auto --warm-each --repeats 2 --backend fa4 --chunk-pages none,64 --profile-lengths 131072"
# The capped step with weight gradients added by autograd's add instead of their matmuls (train.fused_grad_accumulation
# off), for the comparison with core-7b-sparse-128k-caps. About 2 minutes.
# Item 4's floor measured beside the step on one machine: the FA4 stack at 128K and the capped sparse step (as
# `oomb train` runs it), both profiled; the record's sparse_floor is the stack's step outside its attention kernels
# plus the sparse step's own attention kernels. The stack's 128K peak (78.2 GiB) is within a GiB of an H100's
# memory: expandable segments, as its user there would set. About 6 minutes.
job core-7b-sparse-128k-floor "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True $C --lengths '' --baseline-lengths 131072 \
  --baseline-stacks fa4 --sparse-cache-lengths 131072 --chunk 8192 --recompute layer-host --fused-ops auto --warm-each \
  --repeats 2 --backend fa4 --chunk-pages 64 --profile-lengths 131072 --out \"\$OUT/core-7b-sparse-128k-floor.json\""
# The default sparse step alone (as in core-7b-sparse-128k-floor, no stack, no profile). About 2 minutes.
job core-7b-sparse-128k-default "$C --lengths '' --sparse-cache-lengths 131072 --chunk 8192 --recompute layer-host \
  --fused-ops auto --warm-each --repeats 2 --backend fa4 --chunk-pages 64"
job core-7b-sparse-128k-grad-plain "$C --lengths '' --sparse-cache-lengths 131072 --chunk 8192 --recompute layer-host \
  --fused-ops auto --warm-each --repeats 2 --backend fa4 --chunk-pages 64 --grad-accumulation plain"
# The same step with the page-sparse calls on the Triton kernels (--no-fa4-block-sparse), chunks of 8192.
job core-7b-sparse-128k-layer-host "$C $G0 --lengths '' --sparse-cache-lengths 131072 --chunk 8192 --recompute layer-host \
  --fused-ops auto --warm-each --repeats 2 --backend fa4 --no-fa4-block-sparse --profile-lengths 131072"
job core-7b-sparse-128k-mean "$C $G0 --lengths '' --sparse-cache-lengths 131072 --select-score mean --fused-ops auto"
job core-7b-sparse-128k-plain "$C --lengths '' --sparse-lengths 131072 --sparse-cache-lengths 131072 --chunk 4096 \
  --fused-ops none --select-score mean"
job sparse-profile-7b-128k "$O $PLAIN $NOSPLIT --select-blocks 4096 --profile-length 131072 --profile-stacks"
part sparse 'sparse-kernels sparse-steps-7b core-7b-sparse-128k-layer-host core-7b-sparse-128k-fa4-blocks core-7b-sparse-128k-caps core-7b-sparse-128k-floor core-7b-sparse-128k-default core-7b-sparse-128k-grad-plain core-7b-sparse-128k-bound core-7b-sparse-128k-mean core-7b-sparse-128k-plain
  sparse-profile-7b-128k'

# quality: the sparse-quality study (learning and gradient quality of sparse against dense training).
job sparse-quality-study 'python3 -m benchmarks.studies.sparse_quality --out "$OUT/sparse-quality-study" \
  --data-workers 12 --learn-options default,bound
  cp "$OUT/sparse-quality-study/sparse_quality.json" "$OUT/sparse-quality-study.json"
  rm -rf "$OUT/sparse-quality-study/dense_model"'
# The default selection with offload: sparse training with a page list per 128 queries, free,
# against blocks that choose among one or two budgets of pages a chunk (train.chunk_pages: what
# offload moves per layer and chunk; one budget is train.chunk_pages=auto with offload), learning arms only.
# About 7 minutes.
job sparse-quality-blocks 'python3 -m benchmarks.studies.sparse_quality --out "$OUT/sparse-quality-blocks" \
  --data-workers 12 --learn-options bound,bound+chunk_pages,bound+chunk_pages2x --no-gradient-study
  cp "$OUT/sparse-quality-blocks/sparse_quality.json" "$OUT/sparse-quality-blocks.json"
  rm -rf "$OUT/sparse-quality-blocks/dense_model"'
part quality 'sparse-quality-study sparse-quality-blocks'

# offload: pages in host memory: overhead, where it goes, memory growth, the longest contexts, bit identity.
job offload-overhead-7b "$O $PLAIN --preset qwen2.5-7b --chunk 4096 --dense-lengths 65536 --sparse-lengths 131072 \
  --growth-lengths '' --select-blocks 4096,128"
# Offload at the defaults, sparse (targets: <= 5% step time, <= 10 MB of GPU memory per 10K tokens):
# chunks of 8192 (what `oomb train` picks with train.offload at 128K), blocks of 128 choosing among 64 pages a chunk
# (train.chunk_pages=auto with offload), every page on the host, against the same steps without offload; then a 512K
# step, so the GPU memory growth per token with every page on the host comes from 128K to 512K. About 6 minutes.
job offload-sparse-default-7b "$O --preset qwen2.5-7b --chunk 8192 --dense-lengths '' --sparse-lengths 131072 \
  --growth-lengths 524288 --select-blocks 128 --chunk-pages 64"
# The dense pair at the same chunks, liger's ops and FA4 (offload-overhead-7b has the dense pair at chunks of 4096
# without them). About 3 minutes.
job offload-overhead-7b-dense-default "$O --preset qwen2.5-7b --chunk 8192 --dense-lengths 65536 --sparse-lengths '' \
  --growth-lengths ''"
# At the defaults: GPU memory per extra 10K tokens with every page on the host, chunks of 8192, blocks
# of 128 among 64 pages a chunk, fused ops and FA4, from 128K through 512K to 1M (the longest that every page on the
# 125.8 GiB host allows). One step per length. About 8 minutes.
job offload-growth-7b-default "$O --preset qwen2.5-7b --chunk 8192 --dense-lengths '' --sparse-lengths '' \
  --growth-lengths 131072,524288,1048576 --select-blocks 128 --chunk-pages 64 --host-margin-gib 4"
job offload-overhead-7b-one-list "$O $PLAIN --dense-lengths '' --sparse-lengths 131072 --growth-lengths '' --select-blocks 4096"
job offload-profiles-7b "$O $PLAIN --preset qwen2.5-7b --chunk 4096 $NOSPLIT --profile-dense-length 65536 \
  --profile-length 131072 --select-blocks 4096"
job offload-memory-growth-7b "$O $PLAIN --preset qwen2.5-7b --chunk 4096 --dense-lengths '' --sparse-lengths '' \
  --growth-lengths 65536,131072,262144,524288 --select-blocks 4096,128"
job offload-longest-7b "$O $PLAIN --preset qwen2.5-7b $NOSPLIT --longest-lengths 1048576,983040,917504 --longest-first-fit \
  --select-blocks 4096 --chunk 4096 --host-margin-gib 4"
# The longest step with both memories filled: the store keeps whole layers in what the plan leaves free on the GPU
# (--offload-gpu-memory auto, as train.offload_gpu_memory=auto), the rest on the host; the planner's longest first,
# then 95% and 90% of it (targets: >= 1.8M tokens, the planner within 5% of what runs). About 9 minutes.
job offload-longest-7b-split "$O $G0 --preset qwen2.5-7b $NOSPLIT --longest-lengths plan --longest-first-fit \
  --select-blocks 4096 --chunk 4096 --host-margin-gib 4 --offload-gpu-memory auto"
# A 1M-token sparse step with fused ops and the pages split between GPU and host, one page list per chunk of 8192.
# Target: <= 150 s (offload-longest-7b: 230 s with every page on the host, block 4096, chunks of 4096, no fused ops).
# One more step under the profiler says where the time goes. About 7 minutes.
job sparse-1m-7b "$O $G0 --preset qwen2.5-7b $NOSPLIT --longest-lengths 1048576 --select-blocks 8192 --chunk 8192 \
  --host-margin-gib 4 --offload-gpu-memory auto --profile-longest"
# The same step as `oomb train` runs it with offload: blocks of 128 choosing among 64 pages a chunk
# (train.chunk_pages=auto), FA4 gathering only those. Its first step (allocating the store, pinning the host's share)
# timed apart, a second step timed as a run's later steps are. About 6 minutes. (With --profile-longest as well it
# runs past a device call's 10 minutes on an H100: the profile has its own job.)
job sparse-1m-7b-chunk-pages "$O --preset qwen2.5-7b $NOSPLIT --longest-lengths 1048576 --longest-steady --select-blocks 128 \
  --chunk-pages 64 --chunk 8192 --host-margin-gib 4 --offload-gpu-memory auto"
# Where that step's time goes: one step timed (the first, which allocates and pins the store), then
# one under the profiler, kernels only. About 7 minutes.
job sparse-1m-7b-profile "$O --preset qwen2.5-7b $NOSPLIT --longest-lengths 1048576 --select-blocks 128 \
  --chunk-pages 64 --chunk 8192 --host-margin-gib 4 --offload-gpu-memory auto --profile-longest"
job offload-longest-0.5b "$O $PLAIN --preset qwen2.5-0.5b $NOSPLIT --longest-lengths 4194304,3670016,3145728 \
  --longest-first-fit --select-blocks 4096 --chunk 4096 --host-margin-gib 4"
job offload-repeat-0.5b "$O $PLAIN --preset qwen2.5-0.5b $NOSPLIT --repeat-steps 20 --repeat-length 32768 \
  --select-blocks 4096 --chunk 4096"
job offload-copy-bandwidth 'python3 -m benchmarks.copy'
job offload-bit-identity 'python3 -m benchmarks.offload_check'
part offload 'offload-sparse-default-7b offload-overhead-7b-dense-default offload-growth-7b-default offload-overhead-7b offload-overhead-7b-one-list offload-profiles-7b offload-memory-growth-7b
  offload-longest-7b offload-longest-7b-split sparse-1m-7b sparse-1m-7b-chunk-pages sparse-1m-7b-profile offload-longest-0.5b offload-repeat-0.5b offload-copy-bandwidth offload-bit-identity'

# faults: interrupted, killed and refused runs of oomb train at 128K; a forced out-of-memory error (alone).
job faults-h200 'python3 -m benchmarks.faults --skip-oom --out "$OUT/faults-h200"
  cp "$OUT/faults-h200/faults.json" "$OUT/faults-h200.json"'
job faults-oom-h200 'python3 -m benchmarks.faults --only-oom --out "$OUT/faults-oom-h200"
  cp "$OUT/faults-oom-h200/faults-oom.json" "$OUT/faults-oom-h200.json"'
part faults 'faults-h200 faults-oom-h200'

# longrun: Qwen2.5-0.5B from random init learns the passkey task up to 128K tokens in one ~10-minute call,
# then `oomb eval` measures its retrieval (docs/eval.md).
job longrun-0.5b-128k 'OUT="$OUT/longrun-0.5b-128k" DIGITS=1 CURRICULUM="128:64:160:5e-4 1024:16:30:4e-4 16384:2:30:2e-4" \
    LONG_LEN=131072 LONG_LR=1e-4 LONG_STEPS=400 CHUNK=4096 DEADLINE=553 EVAL_RESERVE=150 LONG_MIN_S=120 \
    EVAL_LENGTHS=4k,32k,128k EVAL_DEPTHS=0.1,0.5,0.9 EVAL_SAMPLES=6 bash benchmarks/longrun.sh
  python3 -m benchmarks.records longrun "$OUT/longrun-0.5b-128k/longrun" \
    --command "bash benchmarks/h200.sh longrun-0.5b-128k" --out "$OUT/longrun-0.5b-128k.json"
  cp "$OUT/longrun-0.5b-128k/longrun/eval/retrieval.png" "$OUT/longrun-0.5b-128k-retrieval.png"
  cp "$OUT/longrun-0.5b-128k/longrun/long131072/training.png" "$OUT/longrun-0.5b-128k-training.png"'
part longrun 'longrun-0.5b-128k'

# sparse-long: the sparse-training study (benchmarks/studies/sparse_long.py): dense against page-sparse training of
# a 194M-parameter model extended to 256K (two seeds), the sparse one then to 1M, on the Python sources of the machine's
# packages. Resumable: each call runs what fits in 520 s (run folders in /tmp/sparse-long, kept while the machine is
# warm; on a fresh machine the steps whose inputs are gone run again) and copies state, record and tables to
# $OUT/sparse-long; put the state.json that comes back at ./sparse-long-state.json for the next machine. Call again
# until sparse_long.md says every step is done: about 65 min of device time over three fresh machines (its docstring).
job sparse-long 'python3 -m benchmarks.studies.sparse_long --out /tmp/sparse-long --budget-seconds 520 \
    --state-from sparse-long-state.json --copy-to "$OUT/sparse-long"
  cp "$OUT/sparse-long/sparse_long.json" "$OUT/sparse-long.json"'
part sparse-long 'sparse-long'

# A bench job that writes its own report gets --out $OUT/NAME.json; the others name their outputs themselves.
command_of() {
  local name=$1 cmd=${JOB[$1]}
  local one_line=${cmd//$'\\\n'/}  # continuation lines joined
  if [[ $cmd == "python3 -m benchmarks."* && $one_line != *$'\n'* && $cmd != *" --out "* ]]; then
    cmd="$cmd --out \"\$OUT/$name.json\""
  fi
  printf '%s' "$cmd"
}

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
dry=0
wanted=()
for arg in "$@"; do
  case $arg in
    --dry-run) dry=1 ;;
    --list) for p in "${PARTS[@]}"; do echo "$p:" ${PART[$p]}; done; exit 0 ;;
    -h|--help) usage ;;
    all) for p in "${PARTS[@]}"; do wanted+=(${PART[$p]}); done ;;
    *) if [[ -n ${PART[$arg]+x} ]]; then wanted+=(${PART[$arg]})
       elif [[ -n ${JOB[$arg]+x} ]]; then wanted+=("$arg")
       else echo "h200.sh: no part or job '$arg' (bash benchmarks/h200.sh --list)" >&2; exit 2; fi ;;
  esac
done
if [ ${#wanted[@]} -eq 0 ]; then usage; fi

if [ "$dry" = 1 ]; then
  for name in "${wanted[@]}"; do printf '### %s\n%s\n' "$name" "$(command_of "$name")"; done
  exit 0
fi

mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Each step below is skipped where an earlier call on the same machine did it (a warm machine keeps /tmp).
if ls .whl/*.whl >/dev/null 2>&1; then
  wheels=$(ls .whl/*.whl | xargs -n1 basename | sort | tr "\n" " ")
  if [ "$(cat /tmp/site/.oomb-wheels 2>/dev/null)" != "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl && echo "$wheels" > /tmp/site/.oomb-wheels
  fi
fi
[ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
# flash-attn-4's CUDA 13 libraries (nvidia-cutlass-dsl-libs-cu13, 92 MB) travel as an xz tarball of the unpacked
# wheel in two parts (one per device call: a call carries 64 MiB; the first call's part stays in .whl on the
# machine): join them over the wheels installed above.
if [ ! -d /tmp/site/nvidia_cutlass_dsl/cu13 ] && ls .whl/cu13.part.* .whl2/cu13.part.* >/dev/null 2>&1; then
  cat .whl/cu13.part.* .whl2/cu13.part.* | xz -d | tar x -C /tmp/site
fi
if [ -d /tmp/site/nvidia_cutlass_dsl/cu13 ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/site/nvidia_cutlass_dsl/dsl_packages  # pip --target skips its .pth
fi
# Unsloth's wheels (unsloth, unsloth_zoo, trl, datasets, dill, multiprocess; pyarrow where the image's is missing
# or older than 21) unpacked into /tmp/unsloth_site, checked against their sums; only its jobs put it on their path.
if [ ! -f /tmp/unsloth_site/.done ] && [ -f .unsloth/carry/unsloth-site.tar.xz ]; then
  (cd .unsloth/carry && sha256sum -c --quiet SHA256SUMS) && mkdir -p /tmp/unsloth_site \
    && for t in unsloth-site bnb; do xz -dc ".unsloth/carry/$t.tar.xz" | tar x -C /tmp/unsloth_site; done \
    && { python3 -c 'import pyarrow as p, sys; sys.exit(int(p.__version__.split(".")[0]) < 21)' 2>/dev/null \
         || xz -dc .unsloth/carry/pyarrow.tar.xz | tar x -C /tmp/unsloth_site; } && touch /tmp/unsloth_site/.done
fi
# bitsandbytes for QLoRA (the image lacks it): its wheel unpacked with the CUDA 13 libraries only (7 MB of 43).
if [ ! -d /tmp/site/bitsandbytes ] && [ -f .whl2/bnb.tar.xz ]; then xz -dc .whl2/bnb.tar.xz | tar x -C /tmp/site; fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; free -b | head -2
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  git rev-parse HEAD; git status --porcelain; } > "$OUT/machine.txt" 2>&1
failed=()
for name in "${wanted[@]}"; do
  echo "=== $name ($SECONDS s so far)"
  if [ -n "${TIMEOUT:-}" ]; then runner=(timeout "$TIMEOUT" bash -c); else runner=(bash -c); fi
  "${runner[@]}" "set -e; $(command_of "$name")" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -5 "$OUT/$name.log" | cut -c1-240
  if [ "$rc" != 0 ]; then echo "=== $name failed (exit $rc): $OUT/$name.log"; failed+=("$name"); fi
done
echo "=== done in $SECONDS s; results in $OUT${failed[*]:+; failed: ${failed[*]}}"
[ ${#failed[@]} -eq 0 ]
