"""Every causal LM class of the installed transformers through oomb's step: exact, or refused before any work.

The verdicts are tests/models/verdicts.py's; docs/models.md publishes them (tests/models/table.py writes it). The
sweep builds each family's tiny model (tests/models/families.py) and compares one chunked step with transformers'
own full-sequence step (tests/models/sweep.py); a refusal must come before any gradient is written.
"""

import re
from pathlib import Path

import pytest
from sweep import check_family
from verdicts import EXACT, EXPECTED, MODEL_TYPES

DOC = Path(__file__).parents[2] / "docs" / "models.md"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_family_is_exact_or_refused_before_any_work(model_type):
    assert model_type in EXPECTED, (f"{model_type} is new in this transformers: run it through the sweep, add its "
                                    "verdict to tests/models/verdicts.py and regenerate docs/models.md")
    outcome = check_family(model_type)
    assert outcome.verdict != "wrong", f"{model_type}: {outcome.detail}"
    want = EXPECTED[model_type]
    if want == EXACT:
        assert outcome.verdict == "exact", f"{model_type} was exact, now {outcome.verdict}: {outcome.detail}"
        return
    verdict, phrase = want.split(": ", 1)
    assert (outcome.verdict, phrase in outcome.detail) == (verdict, True), (
        f"{model_type}: expected {want!r}, got {outcome.verdict}: {outcome.detail}")


def test_the_table_lists_only_families_transformers_has():
    assert sorted(set(EXPECTED) - set(MODEL_TYPES)) == []


def test_docs_models_md_says_what_the_sweep_expects():
    rows = dict(re.findall(r"^\| (\S+) \| \S+ \| ([a-z ]+) \|", DOC.read_text(), flags=re.M))
    names = {"exact": "exact", "refused": "refused", "not run": "not a text decoder"}
    assert rows == {family: names[want.split(":")[0]] for family, want in EXPECTED.items()}
