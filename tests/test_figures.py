"""Every measured figure the README and docs quote matches the record it cites (benchmarks/figures.py has
the convention), README.md and docs/benchmarks.md quote none without one, and every record is cited."""

import re

import pytest

from benchmarks import figures as fig

RECORD = {"results": [{"step_s": 13.6650283, "seq_len": 65536}, {"step_s": 42.72, "seq_len": 131072}],
          "offload_overhead": {"dense@65536": 0.0046216}, "count": 1048576,
          "rows": [{"loss": 0.009}, {"loss": 4.86}, {"loss": 0.02}]}


@pytest.fixture
def record(monkeypatch):
    on_disk = fig.load_record
    monkeypatch.setattr(fig, "load_record", lambda name: RECORD if name == "r.json" else on_disk(name))


def _check(text: str) -> list[str]:
    return fig.mismatches(fig.citations(text, "doc.md"))


def test_a_figure_matches_at_the_precision_printed(record):
    assert _check("a step in **13.67 s**<!-- r.json: results[0].step_s --> at 64K") == []
    assert _check("| 64K | 13.7 s<!-- r.json: results[0].step_s --> |") == []
    assert _check("+0.5%<!-- r.json: offload_overhead[\"dense@65536\"] * 100 -->") == []
    assert _check("3.1x<!-- r.json: results[1].step_s / results[0].step_s -->") == []
    assert _check("1,048,576 tokens<!-- r.json: count -->") == []
    assert _check("steps under 0.03: 2<!-- r.json: sum(rows[:].loss < 0.03) --> of 3") == []
    assert _check("−29.1 s<!-- r.json: results[0].step_s - results[1].step_s -->") == []


def test_a_wrong_figure_is_reported_with_what_the_record_says(record):
    problems = _check("a step in 13.76 s<!-- r.json: results[0].step_s -->")
    assert len(problems) == 1 and "doc.md:1: 13.76" in problems[0] and "the record gives 13.67" in problems[0]
    assert _check("13.66 s<!-- r.json: results[0].step_s -->")  # rounded down where the value rounds up


def test_a_citation_that_cannot_be_read_is_reported(record):
    assert "no 'step'" in _check("13.67 s<!-- r.json: results[0].step -->")[0]
    assert "no such record" in _check("13.67 s<!-- nope.json: results[0].step_s -->")[0]
    assert "outside the citation syntax" in _check("1<!-- r.json: __import__('os') -->")[0]
    assert "not a number" in _check("1<!-- r.json: results[0] -->")[0]
    with pytest.raises(fig.CitationError, match="follows no number"):
        fig.citations("no figure here<!-- r.json: count -->", "doc.md")


def test_uncited_measured_figures_are_found():
    text = """A step took 13.67 s<!-- r.json: results[0].step_s --> and 4.2 GiB, at 64K, with 2 stages.
The target: ≤ 14 s. `python -m benchmarks.core --chunk 8192` runs 1 s or so.
| row | step | peak |
| --- | ---: | ---: |
| 64K, chunk 8192 | 13.67 s<!-- r.json: results[0].step_s --> | 82.7 GiB |
"""
    assert fig.uncited(text, "doc.md") == ["doc.md:1: '4.2' has no citation", "doc.md:2: '1' has no citation",
                                           "doc.md:5: '82.7' has no citation"]


def test_every_cited_figure_in_the_docs_matches_its_record():
    problems, cited = [], 0
    for path in fig.doc_paths():
        cites = fig.citations(path.read_text(), str(path.relative_to(fig.ROOT)))
        cited += len(cites)
        problems += fig.mismatches(cites)
    assert not problems, "\n".join(problems)
    assert cited > 100


@pytest.mark.parametrize("doc", ["README.md", "docs/benchmarks.md"])
def test_measured_figures_carry_a_citation(doc):
    problems = fig.uncited((fig.ROOT / doc).read_text(), doc)
    assert not problems, "\n".join(problems)


def test_every_record_is_cited_and_every_linked_record_exists():
    texts = {p: p.read_text() for p in [*fig.doc_paths(), fig.ROOT / "benchmarks" / "README.md"]}
    cited = {c.record for p, t in texts.items() for c in fig.citations(t, p.name)}
    linked = {m for t in texts.values() for m in re.findall(r"\]\((?:\.\./)?benchmarks/results/([\w.+-]+)\)", t)}
    records = {p.name for p in fig.RESULTS.iterdir()}
    assert not (linked - records), f"links to records that do not exist: {sorted(linked - records)}"
    assert not (records - cited - linked), f"records no doc cites or links: {sorted(records - cited - linked)}"
