"""A random-init model folder for benchmarks/studies/sparse_long.py: a preset's architecture, another vocabulary.

    python -m benchmarks.studies.init_model --out DIR --preset qwen2.5-0.5b --tokenizer CORPUS/tokenizer \\
        --positions 16384 --layers 12

The preset's config (oomb/train/presets/NAME.json) with ``vocab_size`` = the tokenizer's ids rounded up to a
multiple of 64, ``max_position_embeddings`` = ``--positions`` (the first training length, which YaRN's
``original_max_position_embeddings`` then defaults to) and, with ``--layers``, that many layers; weights from
transformers' own init under ``--seed``, saved in ``--dtype`` with the tokenizer beside them, and DIR/init.json
(parameters, layers, vocabulary). `oomb train model.path=DIR` trains it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.init_model",
                                description="A random-init model folder (weights and tokenizer): a preset's "
                                "architecture with the tokenizer's vocabulary (rounded up to a multiple of 64).")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", required=True)
    p.add_argument("--tokenizer", type=Path, required=True)
    p.add_argument("--positions", type=int, required=True, help="max_position_embeddings: the first training length")
    p.add_argument("--layers", type=int, default=None, help="this many of the preset's layers (default all)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from importlib import resources

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    fields = json.loads((resources.files("oomb.train") / "presets" / f"{a.preset}.json").read_text())
    fields.pop("_comment", None)
    tok = AutoTokenizer.from_pretrained(str(a.tokenizer), local_files_only=True)
    fields.update(vocab_size=-(-len(tok) // 64) * 64, max_position_embeddings=a.positions,
                  eos_token_id=tok.eos_token_id)
    if a.layers:
        fields["num_hidden_layers"] = a.layers
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(a.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(getattr(torch, a.dtype))
    model.save_pretrained(str(a.out))
    tok.save_pretrained(str(a.out))
    info = {"preset": a.preset, "layers": config.num_hidden_layers, "vocab_size": config.vocab_size,
            "parameters": sum(x.numel() for x in model.parameters()), "dtype": a.dtype, "seed": a.seed,
            "max_position_embeddings": a.positions}
    (a.out / "init.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{a.out}: {info['parameters'] / 1e6:.1f}M parameters, {info['layers']} layers, vocabulary {len(tok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
