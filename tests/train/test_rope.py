"""model.rope.*: the settings reach the model's rotary embedding as transformers computes them, the export's
config.json carries them and loads back, bad values are refused, and a long data.seq_len is warned about."""

import json

import pytest
import torch
from helpers import rel_err
from tiny_models import tiny_model
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import oomb
from oomb.cli import main
from oomb.train.config.checks import check_config
from oomb.train.config.presets import preset_config
from oomb.train.config.rope import RopeConfig, apply_rope
from oomb.train.config.settings import ConfigError, load_config
from oomb.train.data.inputs import model_config
from oomb.train.loop.model import build

FAST = ["train.chunk_size=128", "train.page_size=64", "train.device=cpu", "train.lr=0.01", "train.warmup_steps=1"]
CPU = torch.device("cpu")


@pytest.fixture
def short_model(tmp_path):
    """A model folder of 128 positions (a "short-context" pretrained model) with a byte-level vocabulary."""
    folder = tmp_path / "short"
    tiny_model("llama", vocab_size=300, max_position_embeddings=128).save_pretrained(folder)
    return folder


def _reference_config(rope_parameters: dict, max_positions: int):
    """The tiny preset's config with ``rope_parameters``, built by transformers alone (no oomb code)."""
    fields = preset_config("tiny").to_dict()
    fields.update(rope_parameters=rope_parameters, max_position_embeddings=max_positions)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


@pytest.mark.parametrize("kind,extra,max_positions", [
    ("linear", {}, 32768),
    ("yarn", {"original_max_position_embeddings": 4096}, 32768),
    ("llama3", {"original_max_position_embeddings": 4096, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 32768),
    ("dynamic", {}, 4096),  # dynamic keeps the original length: it scales from it at run time
])
def test_each_scaling_reaches_the_rotary_embedding_as_transformers_computes_it(kind, extra, max_positions):
    cfg = load_config(None, [f"model.rope.type={kind}", "model.rope.original_max_position_embeddings=4096",
                             "model.rope.theta=20000", "data.seq_len=32768"])
    model = build(cfg, CPU, torch.float32)
    rotary = model.model.rotary_emb
    params = {"rope_type": kind, "rope_theta": 20000.0, "factor": 8.0, **extra}  # factor: 32768 / 4096
    reference = _reference_config(params, max_positions)
    assert model.config.rope_parameters == reference.rope_parameters
    assert model.config.max_position_embeddings == max_positions
    seq_len = {"seq_len": 32768} if kind == "dynamic" else {}  # dynamic: the frequencies of a 32768-token sequence
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](reference, CPU, **seq_len)
    torch.testing.assert_close(rotary.inv_freq, inv_freq, rtol=0, atol=0)
    assert rotary.attention_scaling == scaling
    plain, _ = type(rotary).compute_default_rope_parameters(_reference_config({"rope_type": "default",
                                                                               "rope_theta": 20000.0}, 4096))
    assert not torch.allclose(rotary.inv_freq, plain)  # the scaling changed the frequencies


def test_theta_alone_keeps_the_model_scaling_and_default_removes_it(short_model):
    config = json.loads((short_model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    (short_model / "config.json").write_text(json.dumps(config))
    common = [f"model.path={short_model}", "data.seq_len=256"]
    theta = model_config(load_config(None, [*common, "model.rope.theta=5e5"]))
    assert theta.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    plain = model_config(load_config(None, [*common, "model.rope.type=default"]))
    assert plain.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert model_config(load_config(None, common)).rope_parameters == config["rope_parameters"]  # nothing set


def test_export_carries_the_rope_and_loads_back(tmp_path, short_model):
    out = tmp_path / "run"
    assert main(["train", f"out_dir={out}", f"model.path={short_model}", "model.rope.type=yarn", "data.seq_len=512",
                 "train.steps=1", *FAST]) == 0
    written = json.loads((out / "export" / "config.json").read_text())
    assert written["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                          "original_max_position_embeddings": 128}
    assert written["max_position_embeddings"] == 512
    recorded = json.loads((out / "config.json").read_text())["model"]["rope"]
    assert recorded["type"] == "yarn" and recorded["factor"] == 4.0  # the factor it settled, not null
    loaded = AutoModelForCausalLM.from_pretrained(out / "export")
    trained = build(load_config(out / "config.json"), CPU, torch.float32)
    torch.testing.assert_close(loaded.model.rotary_emb.inv_freq, trained.model.rotary_emb.inv_freq, rtol=0, atol=0)
    assert loaded.model.rotary_emb.attention_scaling == trained.model.rotary_emb.attention_scaling != 1.0
    # A resume at a longer data.seq_len keeps the factor the weights were trained with (null would give 8).
    assert main(["train", f"resume={out}", "train.steps=2", "data.seq_len=1024"]) == 0
    assert json.loads((out / "export" / "config.json").read_text())["rope_parameters"]["factor"] == 4.0


def test_dynamic_scaling_trains_chunks_like_one_full_sequence(short_model):
    """Pinned, every chunk rotates with the frequencies of the whole sequence: the gradient is the full one.
    (The loss of a random-init model hardly depends on positions; its gradients do.)"""
    cfg = load_config(None, [f"model.path={short_model}", "model.rope.type=dynamic", "data.seq_len=512"])
    pinned = build(cfg, CPU, torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(short_model, config=model_config(cfg), attn_implementation="eager")
    ids = torch.randint(0, 300, (1, 512))
    out = reference(input_ids=ids, labels=ids)
    out.loss.backward()
    loss = oomb.chunked_backward(pinned, ids, chunk_size=128, page_size=64)
    assert rel_err(loss, out.loss) <= 1e-5
    grads = {n: p.grad for n, p in reference.named_parameters()}
    errors = {n: rel_err(p.grad, grads[n]) for n, p in pinned.named_parameters()}
    assert max(errors.values()) <= 1e-5, max(errors.items(), key=lambda kv: kv[1])
    # transformers alone would recompute the frequencies per chunk; the engine holds them for its pass
    # (oomb.engine.rope), so a model loaded without the pin trains the same.
    unpinned = AutoModelForCausalLM.from_pretrained(short_model, config=model_config(cfg))
    oomb.chunked_backward(unpinned, ids, chunk_size=128, page_size=64)
    assert max(rel_err(p.grad, grads[n]) for n, p in unpinned.named_parameters()) <= 1e-5


@pytest.mark.parametrize("overrides,match", [
    (["model.rope.type=ntk"], "model.rope.type='ntk': choose linear, dynamic, yarn or llama3"),
    (["model.rope.factor=4"], "model.rope.factor applies only to a RoPE scaling: set model.rope.type"),
    (["model.rope.type=yarn", "model.rope.factor=0.5"], "model.rope.factor=0.5 must be >= 1"),
    (["model.rope.theta=0"], "model.rope.theta=0 must be > 0"),
    (["model.rope.type=yarn", "model.rope.original_max_position_embeddings=0"], "must be positive"),
    (["model.rope.type=yarn", "model.rope.low_freq_factor=1"], "applies only to model.rope.type=llama3"),
    (["model.rope.type=llama3", "model.rope.low_freq_factor=4", "model.rope.high_freq_factor=1"],
     "needs 0 < low_freq_factor < high_freq_factor"),
])
def test_bad_values_are_refused_before_work(overrides, match):
    with pytest.raises(ConfigError, match=match):
        check_config(load_config(None, overrides))


def test_a_model_without_one_rope_is_refused():
    config = preset_config("tiny")
    config.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}
    with pytest.raises(ValueError, match="one RoPE per layer type"):
        apply_rope(RopeConfig(theta=5e5), config, 4096)
    config.rope_parameters = None
    with pytest.raises(ValueError, match="has no RoPE parameters"):
        apply_rope(RopeConfig(type="yarn"), config, 4096)
    apply_rope(RopeConfig(), config, 4096)  # nothing set: nothing to apply, whatever the model


def test_long_sequences_are_warned_about_and_pointed_at_the_rope_keys(tmp_path, capsys, short_model):
    common = [f"model.path={short_model}", "data.seq_len=256"]
    assert main(["train", f"out_dir={tmp_path / 'out'}", "train.steps=1", "train.export=false", *common, *FAST]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "warning: data.seq_len=256 is longer than the model's max_position_embeddings=128" in out
    assert "set model.rope.type=yarn (model.rope.factor then defaults to data.seq_len / 128 = 2" in out
    assert main(["plan", *common, "train.device=cpu"]) == 0
    assert "warning: data.seq_len=256 is longer" in capsys.readouterr().out.replace("\n", "")
    assert main(["plan", *common, "train.device=cpu", "--json"]) == 0
    assert "model.rope.type=yarn" in json.loads(capsys.readouterr().out)["warnings"][0]
    assert main(["plan", *common, "train.device=cpu", "model.rope.type=yarn"]) == 0
    out = capsys.readouterr().out.replace("\n", "")
    assert "warning" not in out  # scaled: nothing to warn about, and the RoPE the run gets is said
    assert "note: model.rope: yarn, factor 2 over 128 positions; max_position_embeddings 256, rope_theta 10000" in out
