"""The run configuration: one typed dataclass tree.

Precedence: command-line ``key=value`` > the YAML file > these defaults. Keys are
dotted paths (``train.steps=100``); unknown keys and wrong types raise with a hint.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from oomb.sparse import DEFAULT_SCORE
from oomb.train.config.bounded import (
    MAX_CONFIG_BYTES,
    MAX_JSON_BYTES,
    TooDeep,
    loads_json,
    one_line,
    quoted,
    read_capped,
)
from oomb.train.config.other_names import other_tools_hint  # transformers', TRL's and axolotl's names for keys
from oomb.train.config.rope import RopeConfig
from oomb.train.config.yaml_text import ConfigLoader, Refused, yaml_escaped, yaml_problem


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message says what and where."""


@dataclass
class ModelConfig:
    preset: str = "tiny"
    """Built-in architecture, random init (see `oomb train --list-presets`)."""
    path: str | None = None
    """Hugging Face model folder, or hub id where no such folder exists (cached in HF_HOME); replaces `preset`."""
    dtype: str = "auto"
    """Parameter dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float16 or float32."""
    quantize: str = "none"
    """none, or nf4 (QLoRA, with lora.r > 0): the base's linear layers in 4 bits (bitsandbytes NF4, double
    quantization) computing in model.dtype; embeddings, norms and the LM head stay in model.dtype."""
    trust_remote_code: bool = False
    """Run Python code shipped in model.path (auto_map in its config.json); read that code before setting true.
    A resumed run takes it from the command line only: a run folder's config.json never turns it on."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    """RoPE base and scaling (context extension), written into the model's config and the export's."""
    accept_changed: bool = False
    """resume=RUN only: go on although the base model's weight files differ from those the run recorded when it
    started (<run>/inputs.json: names, sizes, fingerprints; or another hub id or preset); the record then follows
    them. Taken from the command line only, for that one resume."""


@dataclass
class LoraConfig:
    r: int = 0
    """LoRA rank; 0 = full fine-tuning (every parameter trains)."""
    alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    targets: str = "q_proj,k_proj,v_proj,o_proj"
    """Comma-separated names of the linear layers that get adapters (default: attention's four projections), or
    all-linear (peft's name: every linear layer but the LM head)."""
    merge_on_export: bool = True
    """Export the base model with the adapters merged in (a 4-bit base dequantized first), else the adapter folder."""
    fused: bool = True
    """Run peft's LoRA layers fused: the adapter added inside the frozen layer's matmul (same step); false: peft's."""


@dataclass
class DataConfig:
    task: str = "passkey"
    """Training data: passkey or needle (built-in synthetic retrieval), text (the files in data.paths) or chat
    (conversations in data.paths, packed whole, loss on the assistant's tokens; docs/chat.md)."""
    seq_len: int | str = "auto"
    """Tokens per sequence, or auto: 4096, and 256 for the built-in demo (oomb/train/config/demo.py)."""
    paths: list[str] | None = None
    """data.task=text: .txt/.md/.jsonl/.parquet files (a named file of any suffix is text), folders (searched
    recursively), globs or save_to_disk folders; data.task=chat: .jsonl/.parquet files, folders or save_to_disk
    folders of rows with messages or prompt/completion."""
    text_field: str = "text"
    """data.task=text: the field of a .jsonl line, or column of a .parquet/dataset, that holds the text."""
    tokenizer: str | None = None
    """data.task=text or chat: tokenizer folder or hub id; null = the model's own (byte-level when it has none)."""
    document_mask: bool = False
    """data.task=text: attention stays inside each packed document, and no token predicts the next document's start
    (data.task=chat always does this for its samples)."""
    passkey_digits: int | str = "auto"
    """Digits of the passkey (or of the needle's value) to retrieve, or auto: 5, and 1 for the built-in demo."""
    depth: float | None = None
    """Where the passkey or needle sits, as a fraction of the sequence; null = random per sequence."""
    needles: int = 1
    """data.task=needle: key/value sentences per sequence, each asked once at the end (M answers per sequence);
    more than 1 spreads them over the sequence and needs data.depth null."""
    loss_on: str = "auto"
    """Which tokens carry loss: all (language modelling of the whole sequence), answer (passkey/needle: the digits
    only; the LM head then runs on those positions alone) or assistant (chat: the assistant messages' tokens);
    auto = assistant for chat, answer for the built-in demo, all otherwise."""
    chat_template: str | None = None
    """data.task=chat: a Jinja chat template, or the path of a file holding one; null = the tokenizer's own. The
    export's tokenizer carries it."""
    overlong: str = "drop"
    """data.task=chat: a sample longer than data.seq_len is dropped (drop) or keeps its first data.seq_len tokens
    (truncate); the counts are printed at startup."""
    suffixes: list[str] | None = None
    """data.task=text: more file suffixes that folders and glob patterns read as text (e.g. [.py, .rs]); a file
    named in data.paths is read whatever its suffix."""
    val_paths: list[str] | None = None
    """data.task=text or chat: held-out data for the validation loss, in data.paths' forms (e.g. owner/name:test)."""
    val_fraction: float = 0.0
    """data.task=text or chat: hold out this fraction of data.paths' rows (the same in every run) for validation."""
    accept_changed: bool = False
    """resume=RUN only: go on although files of data.paths or data.val_paths differ from those the run recorded
    when it started (<run>/inputs.json: sizes and fingerprints; missing, new or other files); the record then
    follows them. Taken from the command line only, for that one resume."""


@dataclass
class TrainConfig:
    steps: int = 120
    """Optimizer steps; or give train.epochs."""
    epochs: float | None = None
    """Passes over the training data instead of train.steps (give one of them): data.task=text or chat from files or
    save_to_disk folders. The steps are worked out at startup from the packed sequences of one pass; config.json
    keeps them in train.steps."""
    batch_size: int | str = "auto"
    """Sequences per chunked_backward call, or auto: 1, and 16 for the built-in demo."""
    grad_accum: int = 1
    """chunked_backward calls per optimizer step (their gradients add up; the loss is averaged over all targets)."""
    optimizer: str = "adamw"
    """adamw (torch), adamw8bit (bitsandbytes, 8-bit states; CPU or CUDA) or paged_adamw8bit (bitsandbytes, CUDA)."""
    master_weights: bool | str = "auto"
    """auto, true or false: step fp32 copies of 16-bit trainable parameters (updates below half a bf16 step are
    kept; 4 B per parameter more, AdamW moments in fp32); auto = on in one process where the memory plan fits
    with them, off under torchrun."""
    lr: float | str = "auto"
    """Peak learning rate (AdamW), in (0, 1], or auto: chosen for what is trained (oomb.train.loop.schedule); changed on
    resume, the schedule continues with the new peak."""
    lr_scheduler: str = "cosine_with_min_lr"
    """The learning-rate schedule, by its name in transformers' get_scheduler: cosine_with_min_lr (warmup, then a
    half cosine down to train.min_lr_ratio of the peak), linear, cosine, cosine_warmup_with_min_lr,
    cosine_with_restarts, polynomial, constant, constant_with_warmup or inverse_sqrt."""
    warmup_steps: int | str = "auto"
    """Steps of linear warmup from 0 to train.lr, or auto: train.warmup_ratio of the steps where that is set, else
    chosen with train.lr=auto's rule."""
    warmup_ratio: float | None = None
    """Warmup as a fraction of the steps (ceil(ratio x steps), as transformers counts it), instead of
    train.warmup_steps (give one of them)."""
    min_lr_ratio: float = 0.1
    """cosine_with_min_lr and cosine_warmup_with_min_lr: the final learning rate as a fraction of the peak."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    chunk_size: int | str = "auto"
    """Tokens per chunk of the chunk-recurrent step (a multiple of page_size), or auto: the memory plan picks the
    largest of 8192, 4096, 2048, ... (1024, ... on CPU; at most the sequence) with the attention cache where one fits
    (chunks of 1024 or more), else the largest without it. Longer chunks run faster on a large GPU and keep more
    activations (Qwen2.5-7B on an H200 at 64K, Triton kernels: 8192 -> 14.01 s, 82.7 GiB; 4096 -> 14.52 s,
    65.8 GiB, both cached; docs/benchmarks.md); `oomb plan` shows the choice and what a size costs."""
    page_size: int = 128
    """Tokens per page of the K/V store."""
    layer_checkpointing: bool = False
    """Recompute each layer inside a chunk during backward: far less activation memory, one more forward."""
    seed: int = 0
    """Seed for model init and data."""
    device: str = "auto"
    """auto (cuda if available), cuda, cuda:N or cpu."""
    save_every: int = 0
    """Write a checkpoint every N steps (0 = only after the last step)."""
    keep_last: int = 0
    """Keep only the newest N checkpoints, deleting older ones after each save (0 = keep all)."""
    on_nonfinite: str = "stop"
    """A NaN/inf loss or gradient: stop (exit, checkpoints untouched) or skip (no update for that step, logged)."""
    final_eval_samples: int | str = "auto"
    """Passkey/needle runs: the last line's retrieval accuracy on this many held-out sequences at data.seq_len
    (<out_dir>/retrieval.json); auto = 100, or a tenth of the sequences trained where fewer; 0 = none."""
    export: bool = True
    """After the last step, write <out_dir>/export (model and tokenizer), a folder from_pretrained loads."""
    report_to: list[str] = field(default_factory=lambda: ["jsonl"])
    """Where each step's metrics go: jsonl (<out_dir>/metrics.jsonl, always written: resume and the plot read it),
    tensorboard (<out_dir>/tensorboard) and wandb (a Weights & Biases run, `pip install 'oomb[wandb]'`; its id is kept
    in <out_dir>/wandb-run.json, so a resumed run continues it; WANDB_MODE=offline writes it under <out_dir>/wandb)."""
    log_chunks: bool = False
    """Write <out_dir>/chunks.jsonl: each chunk's start in each step (its stage, place, the seconds since the step began
    and the GPU memory peak so far), read after the GPU ran what came before it (one sync a chunk): a long step's
    chunk times, and how far a step that never ended got."""
    memory_snapshot: int = 0
    """Record the GPU allocator over the run's first N steps (0: no record; CUDA only) and write
    <out_dir>/memory_snapshot.pickle (every allocation with its stack, for https://pytorch.org/memory_viz) and
    memory_peak.json (what was alive at the peak, summed by the code that made it, beside the memory plan's items);
    also written where a step runs out of memory before step N (docs/memory.md, "Where the memory went")."""
    val_every: int = 0
    """Validation loss every N steps and after the last; 0 = after the last where held-out data is given, else never."""
    val_batches: int = 4
    """Batches of train.batch_size held-out sequences in each validation, the same ones every time."""
    page_budget: int | None = None
    """Page-sparse attention: past pages each block of queries attends, plus its own chunk; null = dense (exact)."""
    select_block: int = 128
    """Page-sparse attention: queries per selection block (each block chooses its own pages)."""
    sink_pages: int = 0
    """Page-sparse attention: the sequence's first pages, always attended (they count towards page_budget)."""
    local_pages: int = 0
    """Page-sparse attention: the pages just before each chunk, always attended (they count towards page_budget)."""
    select_per_head: bool = False
    """Page-sparse attention: one page list per KV head instead of one shared by all heads."""
    chunk_pages: int | str | None = "auto"
    """Page-sparse attention: the most distinct past pages one chunk's blocks choose among (per list), those with
    the best score for any block of the chunk; what offload moves and FlashAttention-4 gathers per layer and chunk.
    auto: page_budget (one page set per chunk, each block still ranks it); null = no cap."""
    select_score: str = DEFAULT_SCORE
    """Page-sparse attention: rank pages by bound (an upper bound over the page's keys from their per-channel min
    and max: a lone matching key is not averaged away) or mean (the paper's: the block's mean query . the page's
    mean key)."""
    gpu_memory: str = "auto"
    """GPU memory this run may use, e.g. 24GiB (to share the card, or to hold a run to a budget): the memory plan
    fits its settings into it (and refuses the run where none fits) and the caching allocator is capped there
    (torch.cuda.set_per_process_memory_fraction); auto: what is free on the GPU when the run starts."""
    offload: bool = False
    """Keep K/V pages and their gradients in pinned host memory, two layers on the GPU (same gradients)."""
    offload_gpu_memory: str = "auto"
    """With train.offload: GPU memory for keeping whole layers' pages on the GPU (the first layers that fit;
    no copies for them, less host memory), e.g. 40GiB; auto: what the memory plan leaves free, less 1 GiB;
    0: only the two working layers."""
    cache_attention: bool | str = "auto"
    """Keep stage 1's attention outputs for stage 2 (one attention forward less per chunk; same gradients; GPU
    memory H*(2D+4) B per token per layer in bf16, 200 KiB/token for Qwen2.5-7B; host: in pinned host memory); with
    offload only host. auto: on where the memory plan fits with it (with offload in host memory, where the host holds
    it beside the pages; off with train.memory_check=false)."""
    recompute: str = "auto"
    """How stage 2 rebuilds a chunk for its backward: chunk (every layer at once), layer (from every layer's input,
    kept by stage 1 on the GPU: one layer's activations at a time) or layer-host (those inputs in pinned host
    memory); same gradients; with offload, the pages and the inputs in host memory (the leanest exact step). auto:
    chunk, or layer-host where the plan fits only with it (without offload)."""
    attention: str = "auto"
    """Attention kernels: auto (FlashAttention-4 where flash-attn-4 is installed and the GPU is Hopper or Blackwell,
    else the Triton kernels on CUDA, PyTorch on CPU), fa4, triton or torch. fa4 runs page-sparse selections on FA4's
    block sparsity on Hopper (OOMB_FA4_BLOCK_SPARSE=0: the Triton kernels), folds GPT-OSS's sinks in around FA4, and
    hands what block sparsity cannot express to the Triton kernels; every choice computes the same attention."""
    fused_ops: str = "auto"
    """Fused RMSNorm, gated MLP and RoPE kernels (liger-kernel) in place of transformers' own (Llama, Mistral, Qwen2,
    Qwen3, Granite, Gemma-3, GPT-OSS's norms and RoPE; same weights and results, fewer passes over memory): auto (on
    CUDA when liger-kernel is installed and train.tensor_parallel is 1), liger (required) or none."""
    fused_grad_accumulation: bool = True
    """Add each weight gradient into .grad inside the matmul that computes it (one kernel instead of a matmul and an
    add per chunk; oomb.surgery.grad_accumulation) for the decoder layers' trained linear layers, on CUDA with
    train.fused_ops other than none, in a single process (under torchrun gradients go through FSDP's hooks)."""
    memory_check: bool = True
    """Before building the model, refuse a run whose memory plan (see `oomb plan`) does not fit this machine."""
    tensor_parallel: int = 1
    """Under torchrun: split each layer's heads, MLP and K/V pages over groups of this many ranks (1 = none)."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    out_dir: str | None = None
    """Run folder (metrics, checkpoints, export); null = runs/<date-time>. A used folder is refused."""
    resume: str | None = None
    """Continue a run: its folder (latest checkpoint) or a checkpoint folder; its config.json is the base."""


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the config file (YAML, or a run's config.json), then ``key=value`` overrides."""
    cfg = Config()
    chosen: set[str] = set()  # keys a config file or the command line set (a run's config.json holds them all)
    if path is not None:
        data = read_config_file(Path(path))
        _apply(cfg, data, prefix="", source=str(path))
        chosen |= set() if Path(path).suffix == ".json" else _dotted(data)
    given: dict[str, str] = {}  # key -> the override that set it: a key set twice is refused, never "the last wins"
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {quoted(item)} must look like key=value (e.g. train.steps=100)")
        other = next((k for k in given if k == key or key.startswith(f"{k}.") or k.startswith(f"{key}.")), None)
        if other is not None:
            raise ConfigError(f"the command line sets {one_line(max(other, key, key=len))} twice "
                              f"({quoted(given[other])}, then {quoted(item)}): give each key once")
        given[key] = item
        nested: dict = {}
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        try:
            node[parts[-1]] = parse_value(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {quoted(item)}: the value is not plain YAML: {yaml_problem(e)}") from e
        _apply(cfg, nested, prefix="", source="command line", raw_text=raw)
        chosen |= _dotted(nested)
    if cfg.train.epochs is not None and "train.steps" in chosen:
        raise ConfigError(f"train.steps={cfg.train.steps} and train.epochs={cfg.train.epochs:g} both set how long the "
                          "run trains: give one of them (train.epochs=null trains train.steps steps)")
    from oomb.train.config.demo import settle_shape  # the auto sizes: the built-in demo's or any other run's

    settle_shape(cfg)
    return cfg


def _dotted(data: dict, prefix: str = "") -> set[str]:
    """The dotted keys a nested mapping sets, sections included."""
    keys = set()
    for key, value in data.items():
        keys.add(f"{prefix}{key}")
        if isinstance(value, dict):
            keys |= _dotted(value, f"{prefix}{key}.")
    return keys


def read_config_file(path: Path) -> dict:
    """The mapping a config file holds: YAML (safe, YAML 1.2 numbers, no duplicate keys, no aliases) or JSON
    (config.json), within the bounds of oomb.train.config.bounded (size, nesting)."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        with open(path, "rb") as f:
            text = read_capped(f, MAX_JSON_BYTES if path.suffix == ".json" else MAX_CONFIG_BYTES).decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}): "
                          "save it as UTF-8") from e
    except (OSError, ValueError) as e:  # ValueError: larger than oomb reads (oomb.train.config.bounded.TooLarge)
        raise ConfigError(f"config file {path} cannot be read: {e}") from e
    if path.suffix == ".json":  # what oomb writes (config.json): read back as written, never through YAML 1.1
        try:
            data = loads_json(text, object_pairs_hook=_unique_json_keys(path))
        except (json.JSONDecodeError, TooDeep) as e:
            raise ConfigError(f"{path} is {'refused' if isinstance(e, TooDeep) else 'not valid JSON'}: {e}") from e
        _upgrade_run_config(data)
    else:
        try:
            data = yaml.load(text, Loader=ConfigLoader) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is {'refused' if isinstance(e, Refused) else 'not valid YAML'}: "
                              f"{yaml_problem(e)}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (model:, data:, train:), not {type(data).__name__}")
    return data


def parse_value(raw: str):
    """One ``key=value`` value as YAML (``null``, ``true``, ``3e-4``, ``[a, b]``); the empty string is null."""
    return yaml.load(raw, Loader=ConfigLoader) if raw else None


def override_text(key: str, value) -> str:
    """``key=value`` that ``load_config`` reads back as exactly ``value`` (the inverse of parse_value).

    JSON is YAML's flow syntax; characters YAML may not hold raw (control and line-separator
    characters, lone surrogates) are written as YAML escapes.
    """
    if value is None:
        return f"{key}=null"
    text = json.dumps(value, allow_nan=False, ensure_ascii=False)
    return f"{key}={yaml_escaped(text)}"


def config_json(cfg: Config) -> str:
    """The resolved config as config.json holds it (read back exactly by ``load_config``)."""
    return json.dumps(config_to_dict(cfg), indent=2, allow_nan=False)


# Keys that were renamed: the error says the new one.
_MOVED_KEYS = {"train.tensorboard": "train.report_to: write train.report_to=[jsonl,tensorboard] for true"}


def _upgrade_run_config(data) -> None:
    """A run folder's config.json written before train.report_to: its train.tensorboard becomes report_to, so the
    run resumes as it started (the user did not write that file and cannot be asked to edit it)."""
    train = data.get("train") if isinstance(data, dict) else None
    if isinstance(train, dict) and "tensorboard" in train and "report_to" not in train:
        train["report_to"] = ["jsonl", "tensorboard"] if train.pop("tensorboard") is True else ["jsonl"]


def _unique_json_keys(path: Path):
    def pairs(items):
        keys = [k for k, _ in items]
        if len(keys) != len(set(keys)):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise ConfigError(f"{path} gives the key {quoted(dup)} twice")
        return dict(items)

    return pairs


def _apply(obj, data: dict, prefix: str, source: str, raw_text: str | None = None) -> None:
    """Set ``data``'s keys on the dataclass ``obj``; ``raw_text`` is a command-line value as typed."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    for key, value in data.items():
        name = f"{prefix}{key}"
        if name in _MOVED_KEYS:
            raise ConfigError(f"{name} ({source}) is now {_MOVED_KEYS[name]}")
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = (f"; {other}" if (other := other_tools_hint(str(key))) is not None else
                    f"; did you mean {prefix}{close[0]}?" if close else f"; known keys: {', '.join(fields)}")
            raise ConfigError(f"unknown config key {quoted(name)} ({source}){hint}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{name} ({source}) must be a section (a mapping), got {quoted(value)}")
            _apply(current, value, prefix=f"{name}.", source=source, raw_text=raw_text)
        else:
            setattr(obj, key, _coerce(value, hints[key], name, source, raw_text))


def _coerce(value, hint, name: str, source: str, raw_text: str | None = None):
    allowed = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if raw_text is not None and str in allowed and not any(_fits(value, t) for t in allowed):
        return raw_text  # `out_dir=2024`, `model.preset=no`: a name typed on the command line stays as typed
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{name} ({source}) cannot be null")
    for t in allowed:
        if typing.get_origin(t) is list:
            (item,) = typing.get_args(t)
            if isinstance(value, item):  # one value where a list is expected: a list of one
                return [value]
            if isinstance(value, list) and all(type(v) is item for v in value):
                return list(value)
            continue
        if t is float and isinstance(value, int | float) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(f"{name} ({source}) must be a finite number, got {value!r}")
            return number
        if t is not type(None) and type(value) is t:
            return value
    expected = " or ".join(f"a list of {typing.get_args(t)[0].__name__}" if typing.get_origin(t) else t.__name__
                           for t in allowed)
    raise ConfigError(f"{name} ({source}) must be {expected}, got {quoted(value)} ({type(value).__name__})")


def _fits(value, t) -> bool:
    if typing.get_origin(t) is list:
        return isinstance(value, list)
    if t is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return type(value) is t


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
