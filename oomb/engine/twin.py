"""Tiny twins: the same architecture as a user's config at toy sizes, to check a model before any work.

    tiny_twin_config(config)  ->  a config of the same class with every feature kept and small sizes:
                                  AutoModelForCausalLM.from_config(twin) builds in fp32 on CPU in well
                                  under a second and runs a 2 x 96-token step in well under a second.

The test sweep and `oomb plan` (where no weights exist) both build the twin and compare oomb's step with
transformers' own eager training on it. What a twin keeps, and how:

    layers        one layer per kind, in order (a kind: every per-layer list, index list, per-layer
                  override and layer-index rule the config has, e.g. layer_types, mlp_only_layers,
                  first_k_dense_replace); a short repeating pattern is kept whole (Gemma-3's 5 local :
                  1 global is 6 layers); counts that depend on the layer index are recounted
    widths        hidden and MLP sizes, ranks: scaled by one factor (hidden -> 64), so sizes that were
                  equal stay equal and sizes that differed still differ
    heads         4 query heads; key/value heads 4 (MHA), 2 (GQA) or 1 (MQA) as in the original
    head sizes    scaled by one factor (the base head -> about 16): per-layer, key and value head sizes
                  keep their ratios; partial rotary factors are kept (the head is sized so they divide)
    experts       top-k at most 2, more experts than top-k, groups kept; shared experts kept
    windows       sliding windows and attention chunks shrink to `window` tokens (a 96-token step
                  exceeds them); RoPE scaling lengths shrink to 64 tokens, rope type and theta kept
    vocabulary    `vocab` tokens; special token ids moved inside it
    the rest      as they are: dropouts, biases, norms, multipliers, soft-caps, sinks, tying

Only fields the config already has are written (through the class's attribute_map). A composite
multimodal config gives the twin of its text model where transformers has a text-only causal LM for it.
Family knowledge lives in oomb/engine/twin_families.py.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from transformers import PretrainedConfig

from oomb.engine import twin_families as fam
from oomb.engine.twin_families import TwinUnavailable

__all__ = ["TwinUnavailable", "tiny_twin_config"]

HIDDEN = 64  # the twin's hidden size
HEADS = 4  # the twin's query heads
MAX_LAYERS = 8  # the longest repeating layer pattern kept whole
ROPE_ORIGINAL = 64  # RoPE scaling's original context in the twin: a 96-token step goes past it


def tiny_twin_config(config: PretrainedConfig, *, window: int = 24, vocab: int = 128) -> PretrainedConfig:
    """A copy of `config` at toy sizes that keeps every architectural feature (module docstring).

    Raises TwinUnavailable (with a sentence a user can read) where no twin can be made: not a decoder-only
    text causal LM, or a config this module cannot shrink."""
    config = fam.text_model_config(config)
    fam.check_decoder(config)
    fields = _Fields(copy.deepcopy(config.to_dict()), type(config))
    try:
        _shrink_model(fields, window=window, vocab=vocab)
        return fields.cls.from_dict(fam.clean(fields))
    except TwinUnavailable:
        raise
    except Exception as err:  # a config validator or a field this module does not know yet
        raise TwinUnavailable(f"{config.model_type}: could not shrink its config ({type(err).__name__}: "
                              f"{str(err).strip()[:300]}).") from err


def _shrink_model(f: _Fields, *, window: int, vocab: int, width: float | None = None) -> None:
    """Layers, sizes and RoPE of one model's config, then its parts and the models nested in it."""
    _shrink_layers(f)
    scales = _Scales.of(f, width)
    _shrink(f, scales, window=window, vocab=vocab)
    _shrink_rope(f, scales)
    for key in fam.PARTS.get(f.model_type, ()):
        if isinstance(f.d.get(key), dict):
            _shrink(f.sub(key), scales, window=window, vocab=vocab)
    keys, shared = fam.SUB_MODELS.get(f.model_type, (("text_config",), None))
    sub_width = None
    if shared and isinstance(f.d.get(shared), dict):
        sub_width = HIDDEN / f.sub(shared).get("hidden_size")
    for key in keys:
        if isinstance(f.d.get(key), dict):
            _shrink_model(f.sub(key), window=window, vocab=vocab, width=sub_width)
    fam.after(f, scales, window=window, vocab=vocab)


class _Fields:
    """A config's to_dict() with reads and writes through the class's attribute_map; writes only existing keys."""

    def __init__(self, d: dict[str, Any], cls: type[PretrainedConfig] | None, model_type: str | None = None):
        self.d, self.cls = d, cls
        self.layers_before = 0  # the original's number of layers, once the twin's are chosen
        self.aliases = dict(getattr(cls, "attribute_map", {}) or {})
        self.model_type = model_type or d.get("model_type") or getattr(cls, "model_type", "")

    def sub(self, key: str) -> _Fields:
        """The nested config dict under `key`, read through its own class's attribute_map."""
        cls = (getattr(self.cls, "sub_configs", None) or {}).get(key)
        return _Fields(self.d[key], cls if isinstance(cls, type) else None)

    def key(self, name: str) -> str:
        return self.aliases.get(name, name)

    def has(self, name: str) -> bool:
        return self.key(name) in self.d

    def get(self, name: str, default: Any = None) -> Any:
        return self.d.get(self.key(name), default)

    def set(self, name: str, value: Any) -> None:
        if self.has(name):
            self.d[self.key(name)] = value

    def first(self, names: tuple[str, ...]) -> str | None:
        """The first of `names` the config has with a positive int value."""
        for name in names:
            value = self.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return self.key(name)
        return None


# ---------------------------------------------------------------------------------------------------- layers


def _layer_signatures(f: _Fields, n: int) -> list[tuple]:
    """What makes layer i differ from the others: its entries in per-layer lists, index lists, per-layer
    overrides, and the layer-index rules of twin_families.LAYER_RULES."""
    sigs: list[list] = [[] for _ in range(n)]
    for key, value in f.d.items():
        if key in fam.INDEX_LISTS and isinstance(value, list):
            base = fam.INDEX_LISTS[key]
            members = {(i - base) % n for i in value if isinstance(i, int)}
            for i in range(n):
                sigs[i].append((key, i in members))
        elif isinstance(value, list) and len(value) == n and key not in fam.NOT_PER_LAYER:
            for i in range(n):
                sigs[i].append((key, repr(value[i])))
    for idx, override in (f.d.get("per_layer_config") or {}).items():
        if int(idx) < n:
            sigs[int(idx)].append(("per_layer_config", repr(sorted(override.items()))))
    for key, rule in fam.LAYER_RULES.items():
        value = f.d.get(key)
        if key in fam.UNREAD_RULES.get(f.model_type, ()):
            continue
        if _ints(value) or isinstance(value, list) and value:
            for i in range(n):
                sigs[i].append((key, rule(i, value, n)))
    return [tuple(s) for s in sigs]


def _choose_layers(sigs: list[tuple]) -> list[int]:
    """The original layers the twin keeps: one period of a short repeating pattern, else the layers left
    when every run of equal layers and every repeated block is collapsed to its first occurrence."""
    n = len(sigs)
    for p in range(1, min(n, MAX_LAYERS) + 1):
        if all(sigs[i] == sigs[i % p] for i in range(n)):
            return list(range(max(p, min(2, n))))
    keep, changed = list(range(n)), True
    while changed:
        changed = False
        for size in range(1, len(keep) // 2 + 1):
            i = 0
            while i + 2 * size <= len(keep):
                if [sigs[j] for j in keep[i : i + size]] == [sigs[j] for j in keep[i + size : i + 2 * size]]:
                    del keep[i + size : i + 2 * size]
                    changed = True
                else:
                    i += 1
    while len(keep) > 2 and sigs[keep[-1]] in {sigs[k] for k in keep[:-1]}:
        keep.pop()  # a last, partial repeat of the pattern (40 layers of a period of 4 after 2 dense ones)
    if len(keep) < 2 <= n:
        keep = sorted(set(keep) | {next(i for i in range(n) if i not in keep)})
    return keep


def _apply_layers(f: _Fields, n: int, keep: list[int], layer_keys: list[str]) -> dict[str, Any]:
    """The config dict with only the layers in `keep` (original indices), everything per-layer remapped."""
    d = copy.deepcopy(f.d)
    new = {old: j for j, old in enumerate(keep)}
    for key, value in f.d.items():
        if key in fam.INDEX_LISTS and isinstance(value, list):
            base = fam.INDEX_LISTS[key]
            d[key] = [new[(i - base) % n] + base for i in value if isinstance(i, int) and (i - base) % n in new]
        elif isinstance(value, list) and len(value) == n and key not in fam.NOT_PER_LAYER:
            d[key] = [value[i] for i in keep]
    if f.d.get("per_layer_config"):
        d["per_layer_config"] = {str(new[int(i)]): o for i, o in f.d["per_layer_config"].items() if int(i) in new}
    for key, recount in fam.LAYER_COUNTS.items():
        value = f.d.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and key in d:
            d[key] = recount(keep, value, n)
    for key in layer_keys:
        d[key] = len(keep)
    return d


def _shrink_layers(f: _Fields) -> None:
    n, layer_keys = fam.layer_count(f)
    f.layers_before = n
    if n < 2:
        return
    sigs = _layer_signatures(f, n)
    keep = _choose_layers(sigs)
    if f.model_type in fam.TWICE:  # each kind of layer twice (layers that share weights across the stack)
        for sig in {sigs[k] for k in keep}:
            twice = [i for i, s in enumerate(sigs) if s == sig][:2]
            keep = sorted(set(keep) | set(twice))
    d = _apply_layers(f, n, keep, layer_keys)
    if _layer_signatures(_Fields(d, f.cls, f.model_type), len(keep)) != [sigs[i] for i in keep]:
        # A layer-index rule does not survive the gaps: keep a prefix of the stack that has every kind.
        last = max(sigs.index(s) for s in set(sigs))
        d = _apply_layers(f, n, list(range(max(last + 1, min(2, n)))), layer_keys)
    f.d.clear()
    f.d.update(d)


# ---------------------------------------------------------------------------------------------------- sizes


class _Scales:
    """The factors every size of one config is shrunk by (shared with its nested configs)."""

    def __init__(self, width: float, head: float, heads: float, main_heads: int, main_kv: int | None, kv: int):
        self.width, self.head, self.heads = width, head, heads
        self.main_heads, self.main_kv, self.kv = main_heads, main_kv, kv

    @staticmethod
    def of(f: _Fields, width: float | None = None) -> _Scales:
        hidden_key = f.first(fam.HIDDEN)
        hidden = f.d[hidden_key] if hidden_key else HIDDEN
        width = width or HIDDEN / hidden
        heads_key = f.first(fam.HEADS)
        heads = f.d[heads_key] if heads_key else HEADS
        kv_key = f.first(fam.KV_HEADS)
        kv = f.d[kv_key] if kv_key else None
        if fam.is_multi_query(f):
            kv = 1
        new_kv = HEADS if kv is None or kv >= heads else (1 if kv == 1 else 2)
        head_key = f.first(fam.BASE_HEAD_DIM)
        head = f.d[head_key] if head_key else hidden / heads
        # The twin's head: its hidden per head (16 at hidden 64) x the original's head / hidden per head.
        target = hidden * width / min(heads, HEADS) * head / (hidden / heads)
        target = fam.fit_head_dim(f, max(4, 2 * round(target / 2)))
        return _Scales(width, target / head, min(1.0, HEADS / heads), heads, kv, new_kv)

    def width_of(self, value: int, multiple: int = 8, least: int = 8) -> int:
        return max(least, multiple * round(value * self.width / multiple))

    def head_of(self, value: int) -> int:
        return max(2, 2 * round(value * self.head / 2))

    def heads_of(self, value: int, kv: bool = False, query: bool = False) -> int:
        if value == self.main_heads:
            return min(value, HEADS)
        if kv and value == self.main_kv:
            return self.kv
        if query:  # query heads of another layer kind: a multiple of the key/value heads they share
            return max(self.kv, self.kv * round(value * self.heads / self.kv))
        return max(1, round(value * self.heads))


def _ints(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _resize(key: str, value: Any, s: _Scales, window: int) -> Any:
    """One size field (an int or a per-layer list of ints) at the twin's scale, by what it measures."""
    if not _ints(value):
        return value
    rules = (
        (fam.WIDTHS, s.width_of), (fam.INTERMEDIATES, lambda v: s.width_of(v, least=16)), (fam.RANKS, s.width_of),
        (fam.QUERY_HEADS, lambda v: s.heads_of(v, query=True)), (set(fam.HEADS) | fam.OTHER_HEADS, s.heads_of),
        (fam.KV_HEADS, lambda v: s.heads_of(v, kv=True)), (fam.HEAD_DIMS, s.head_of),
        (fam.WINDOWS, lambda v: min(v, window)), (fam.STATE_SIZES, lambda v: min(v, 16)),
        (fam.SCAN_CHUNKS, lambda v: min(v, 32)), (fam.SSM_GROUPS, lambda v: min(v, 2)),
        (fam.ZERO_EXPERTS, lambda v: min(v, 2)),
    )
    fn = next((fn for keys, fn in rules if key in keys), None)
    if fn is None:
        return value
    return [fn(v) if v > 0 else v for v in value] if isinstance(value, list) else fn(value)


def _shrink(f: _Fields, s: _Scales, *, window: int, vocab: int) -> None:
    """Widths, heads, head sizes, experts, windows, vocabulary and token ids of one (possibly nested) config."""
    d = f.d
    for key in list(d):
        d[key] = _resize(key, d[key], s, window)
    for idx, override in (d.get("per_layer_config") or {}).items():  # Gemma-4: a layer's own head size
        d["per_layer_config"][idx] = {k: _resize(k, v, s, window) for k, v in override.items()}
    if fam.is_latent_attention(f):  # key head = nope + rope, kept exact after rounding
        if f.has("qk_head_dim") and f.has("qk_nope_head_dim") and f.has("qk_rope_head_dim"):
            d[f.key("qk_head_dim")] = f.get("qk_nope_head_dim") + f.get("qk_rope_head_dim")
    _shrink_experts(f)
    _shrink_vocab(f, vocab)


def _shrink_experts(f: _Fields) -> None:
    """Top-k at most 2, experts more than top-k (a multiple of the groups), at most 2 groups (fewer selected
    than exist where the original selects fewer), 1 shared expert."""
    experts_key, top_key = f.first(fam.EXPERTS), f.first(fam.TOP_K)
    groups_key, top_groups_key = f.first(fam.EXPERT_GROUPS), f.first(fam.TOP_GROUPS)
    old_groups = f.d[groups_key] if groups_key else 1
    groups = min(old_groups, 2)
    top = min(f.d[top_key], 2) if top_key else 1
    if top_key:
        f.d[top_key] = top
    if experts_key:
        least = max(4, top + 2)
        least += -least % groups  # a multiple of the groups
        f.d[experts_key] = min(f.d[experts_key], least)
    if groups_key:
        f.d[groups_key] = groups
    if top_groups_key:
        f.d[top_groups_key] = groups if f.d[top_groups_key] >= old_groups else max(1, groups - 1)
    for key in fam.SHARED_EXPERTS:
        if _ints(f.d.get(key)):
            f.d[key] = min(f.d[key], 1)


def _shrink_vocab(f: _Fields, vocab: int) -> None:
    """`vocab` tokens; token ids at or past it move to distinct ids at its top (the same id to the same id)."""
    old_vocab = f.get("vocab_size")
    for key in fam.VOCABS:
        if _ints(f.d.get(key)) and f.d[key] > vocab:
            f.d[key] = vocab
    if not _ints(old_vocab):
        return
    keys = [k for k in f.d if k.endswith(fam.TOKEN_ID_SUFFIXES)]
    used = {v for k in keys for v in (f.d[k] if isinstance(f.d[k], list) else [f.d[k]])
            if isinstance(v, int) and 0 <= v < vocab}
    moved: dict[int, int] = {}
    free = (i for i in range(vocab - 1, -1, -1) if i not in used)

    def move(v: Any) -> Any:
        if not isinstance(v, int) or isinstance(v, bool) or v < vocab:
            return v
        if v not in moved:
            moved[v] = next(free)
        return moved[v]

    for k in keys:
        f.d[k] = [move(v) for v in f.d[k]] if isinstance(f.d[k], list) else move(f.d[k])


# ---------------------------------------------------------------------------------------------------- rope


def _shrink_rope(f: _Fields, s: _Scales) -> None:
    """RoPE scaling lengths to ROPE_ORIGINAL (a 96-token step goes past the original context), per-dim
    factor lists resampled to the twin's rotary size; rope type, theta and partial factors kept."""
    rope = f.get("rope_parameters")
    if not isinstance(rope, dict):
        per_type = []
    elif rope and all(isinstance(r, dict) for r in rope.values()):
        per_type = list(rope.values())  # one per layer type
    else:
        per_type = [rope]
    originals = [r["original_max_position_embeddings"] for r in per_type
                 if _ints(r.get("original_max_position_embeddings"))]
    if _ints(f.get("original_max_position_embeddings")):
        originals.append(f.get("original_max_position_embeddings"))
    if originals:
        ratio = ROPE_ORIGINAL / max(originals)
        for r in per_type:
            for key in ("original_max_position_embeddings", "max_position_embeddings"):
                if _ints(r.get(key)):
                    r[key] = max(ROPE_ORIGINAL, round(r[key] * ratio))
        for key in ("original_max_position_embeddings", "max_position_embeddings"):
            if _ints(f.get(key)):
                f.set(key, max(ROPE_ORIGINAL, round(f.get(key) * ratio)))
    elif any(r.get("rope_type") == "dynamic" for r in per_type) and _ints(f.get("max_position_embeddings")):
        f.set("max_position_embeddings", ROPE_ORIGINAL)  # dynamic NTK rescales past it
    for r in per_type:
        half = _rotary_half(f, r)
        for key in ("short_factor", "long_factor"):  # one factor per rotary frequency: resampled
            if isinstance(r.get(key), list) and r[key]:
                r[key] = [r[key][math.floor(i * len(r[key]) / half)] for i in range(half)]
        if isinstance(r.get("mrope_section"), list):  # frequencies per position axis: the same shares
            parts = [max(1, round(x * half / sum(r["mrope_section"]))) for x in r["mrope_section"]]
            parts[0] += half - sum(parts)
            r["mrope_section"] = parts


def _rotary_half(f: _Fields, rope: dict) -> int:
    """Half the twin's rotary size (the number of RoPE frequencies) under one rope parameter set."""
    heads = f.get("num_attention_heads") or HEADS
    head = f.get("head_dim") if _ints(f.get("head_dim")) else (f.get("hidden_size") or HIDDEN) // heads
    factor = rope.get("partial_rotary_factor") or f.get("partial_rotary_factor") or 1.0
    return max(1, int(head * factor) // 2)
