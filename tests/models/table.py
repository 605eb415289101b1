"""Write docs/models.md from the sweep: every causal LM class of the installed transformers, exact or why not.

    python -m tests.models.table            # runs the sweep (a few minutes on 2 cores), rewrites docs/models.md

The verdicts are the sweep's (tests/models/sweep.py) and must agree with tests/models/verdicts.py, which the test
suite holds them to; the messages are oomb's own refusals, as a user sees them.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import transformers

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from sweep import check_family  # noqa: E402
from verdicts import EXPECTED, MODEL_TYPES  # noqa: E402

DOC = HERE.parent.parent / "docs" / "models.md"

HEADER = f"""# Supported models

oomb trains a transformers decoder exactly (the loss and gradients of full-sequence training) or refuses it
before any work, naming what it cannot reproduce (docs/design.md, "Which models"). This table is the test
suite's sweep (tests/models/) over every causal LM class of transformers {transformers.__version__}: each
family's default config with its optional features switched on (sliding windows, logit scaling, biases,
soft-caps, sinks, shared experts), as a tiny random model, trained for one step in chunks of 32 tokens against
transformers' own full-sequence step. "exact": the loss and every parameter gradient agree within 1e-5.
Regenerate with `python -m tests.models.table`.

A family listed exact here is exact in the configurations the sweep ran; a checkpoint of it with another
feature switched on is checked again when it is loaded (`oomb plan`, `oomb train` and `OombTrainer` check
before anything runs), so what is not exact is refused, never trained silently wrong.

| model type | class | verdict | why not |
|---|---|---|---|
"""


def _row(model_type: str) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    outcome = check_family(model_type)
    if outcome.verdict == "wrong":
        raise SystemExit(f"{model_type}: oomb trained it wrongly ({outcome.detail}): fix it before the table")
    detail = outcome.detail.replace("|", "/").replace("\n", " ")
    verdict = {"exact": "exact", "refused": "refused", "not run": "not a text decoder"}[outcome.verdict]
    return f"| {model_type} | {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]} | {verdict} | {detail} |"


def main() -> None:
    warnings.filterwarnings("ignore")
    missing = sorted(set(MODEL_TYPES) - set(EXPECTED))
    if missing:
        raise SystemExit(f"families without an expected verdict in tests/models/verdicts.py: {missing}")
    rows = [_row(model_type) for model_type in MODEL_TYPES]
    DOC.write_text(HEADER + "\n".join(rows) + "\n")
    print(f"wrote {DOC} ({len(rows)} families)")


if __name__ == "__main__":
    main()
