"""Packing documents into sequences (order, document ids, labels, exact resume) and the needle task."""

import hashlib
import inspect
import json

import pytest
import torch
from tiny_models import tiny_model

import oomb
from oomb.train.data.corpus import DataError, byte_level_tokenizer
from oomb.train.data.packing import IGNORE_INDEX, PackedCorpus
from oomb.train.data.sources import BOS, DIGIT0, END, KEY, QUERY, NeedleTask

DOCS = [f"document {i}: " + "abcdefghij"[i % 10] * (5 + 7 * i) for i in range(12)]


def _corpus(tmp_path, seq_len=40, **kw):
    folder = tmp_path / "docs"
    folder.mkdir(exist_ok=True)
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:7]))
    for i, d in enumerate(DOCS[7:]):
        (folder / f"t{i}.txt").write_text(d)
    return PackedCorpus(folder, byte_level_tokenizer(), seq_len, **kw)


def _documents_of(stream: list[int], eos: int) -> list[str]:
    docs, current = [], []
    for t in stream:
        if t == eos:
            docs.append(bytes(current).decode())
            current = []
        else:
            current.append(t)
    return docs


def test_the_stream_is_every_document_once_per_epoch_in_a_seeded_order(tmp_path):
    corpus = _corpus(tmp_path, seed=1)
    total = sum(len(d.encode()) + 1 for d in DOCS)
    stream = torch.cat([corpus.next_sequence()[0] for _ in range(total // 40 + 1)]).tolist()
    epoch0 = _documents_of(stream, 256)[: len(DOCS)]
    assert sorted(epoch0) == sorted(DOCS)  # nothing lost, nothing twice, nothing cut
    assert epoch0 != DOCS  # shuffled
    again = _corpus(tmp_path, seed=1)
    assert torch.equal(torch.cat([again.next_sequence()[0] for _ in range(5)]), torch.tensor(stream[:200]))
    other = _corpus(tmp_path, seed=2)
    assert not torch.equal(torch.cat([other.next_sequence()[0] for _ in range(5)]), torch.tensor(stream[:200]))


def test_document_ids_and_labels(tmp_path):
    batch = _corpus(tmp_path, seq_len=64, document_mask=True).batch(3)
    ids, labels, docs = batch.input_ids, batch.labels, batch.doc_ids
    assert ids.shape == labels.shape == docs.shape == (3, 64) and docs.dtype == torch.int64
    for row_ids, row_labels, row_docs in zip(ids, labels, docs, strict=True):
        assert row_docs[0] == 0 and (row_docs.diff() >= 0).all() and (row_docs.diff() <= 1).all()
        starts = torch.nonzero(row_docs.diff() == 1).flatten() + 1
        assert (row_ids[starts - 1] == 256).all()  # a new document begins right after an EOS
        assert (row_labels[starts] == IGNORE_INDEX).all()  # and nothing is asked to predict its first token
        keep = torch.ones(64, dtype=torch.bool)
        keep[starts] = False
        assert torch.equal(row_labels[keep], row_ids[keep])
    plain = _corpus(tmp_path, seq_len=64).batch(3)
    assert plain.doc_ids is None and torch.equal(plain.labels, plain.input_ids)
    assert torch.equal(plain.input_ids, ids)


def test_resume_from_the_saved_position_gives_the_same_next_sequences(tmp_path):
    straight = _corpus(tmp_path, seq_len=48, seed=3, document_mask=True)
    for _ in range(8):  # past the end of the first epoch (the corpus holds ~684 tokens)
        straight.batch(2)
    state = json.loads(json.dumps(straight.state_dict()))  # what a checkpoint stores
    expected = [straight.batch(2) for _ in range(3)]
    resumed = _corpus(tmp_path, seq_len=48, seed=3, document_mask=True)
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.batch(2)
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.labels, want.labels) and torch.equal(got.doc_ids, want.doc_ids)
    assert state["epoch"] == 1


def test_empty_data_and_missing_paths_are_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(DataError, match="holds no text"):
        PackedCorpus(tmp_path / "empty.txt", byte_level_tokenizer(), 16).next_sequence()
    with pytest.raises(DataError, match="does not exist"):
        PackedCorpus(tmp_path / "nope", byte_level_tokenizer(), 16)


def test_needle_task_layout():
    task = NeedleTask(400, digits=4, depth=0.5, seed=2)
    b = task.batch(step=1, batch_size=2)
    assert b.input_ids.shape == (2, 400)
    for row, pos in zip(b.input_ids, b.answer_positions, strict=True):
        key_at = int((row == KEY).nonzero()[0])
        assert abs(key_at - 0.5 * 400) < 12
        key, value = row[key_at + 1 : key_at + 4], row[key_at + 5 : key_at + 9]
        assert row[key_at + 4] == END and row[key_at + 9] == END and (value >= DIGIT0).all()
        query_at = int(pos[0]) - 4
        assert row[query_at] == QUERY and torch.equal(row[query_at + 1 : query_at + 4], key)
        assert torch.equal(row[pos + 1], value)  # the answer is the needle's value
    answer_only = NeedleTask(400, digits=4, loss_on="answer").batch(0, 1)
    assert int((answer_only.labels != -100).sum()) == 4
    with pytest.raises(ValueError, match="too short"):
        NeedleTask(20, digits=5)


def _digest(batch) -> str:
    h = hashlib.sha256()
    for t in (batch.input_ids, batch.labels, batch.answer_positions):
        h.update(t.to(torch.int64).numpy().tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("seq_len,kwargs,digest", [
    # Digests of batch(3, 2) written by the single-needle code before data.needles existed: training runs
    # and oomb eval's retrieval sequences (needles=1, depth given) must not change.
    (400, {"digits": 4, "depth": 0.5, "seed": 2}, "1091934e9bd659bc"),
    (512, {"digits": 2, "seed": 0, "loss_on": "answer"}, "2c646383614ed36e"),
    (300, {"digits": 5, "depth": 0.0, "seed": 7}, "58eb0349761d408f"),
    (1000, {"digits": 3, "depth": 1.0, "seed": 11, "loss_on": "answer", "needles": 1}, "5930ab255d1bc2fd"),
])
def test_one_needle_sequences_are_unchanged(seq_len, kwargs, digest):
    assert _digest(NeedleTask(seq_len, **kwargs).batch(3, 2)) == digest


def _needles_of(row: torch.Tensor, key_tokens: int, digits: int) -> list[tuple[int, tuple, tuple]]:
    """(position, key, value) of every KEY sentence in a sequence."""
    out = []
    for at in (row == KEY).nonzero().flatten().tolist():
        key = tuple(row[at + 1 : at + 1 + key_tokens].tolist())
        assert row[at + 1 + key_tokens] == END and row[at + 2 + key_tokens + digits] == END
        out.append((at, key, tuple(row[at + 2 + key_tokens : at + 2 + key_tokens + digits].tolist())))
    return out


def test_multi_needle_layout_labels_and_determinism():
    m, d, k, n = 8, 2, 3, 1024
    task = NeedleTask(n, digits=d, needles=m, loss_on="answer", seed=4)
    b = task.batch(step=5, batch_size=3)
    assert b.input_ids.shape == (3, n) and b.answer_positions.shape == (3, m * d)
    orders = set()
    for row, pos, labels in zip(b.input_ids, b.answer_positions, b.labels, strict=True):
        assert row[0] == BOS
        needles = _needles_of(row, k, d)
        assert len(needles) == m and len({key for _, key, _ in needles}) == m  # distinct keys
        value_of = {key: value for _, key, value in needles}
        # Needle i lies in the i-th of m equal stretches of the filler: the needles cover the sequence.
        body = n - 1 - m * (k + d + 3) - m * (k + 2 + d)
        for i, (at, _, _) in enumerate(needles):
            assert i * body // m <= at - 1 - i * (k + d + 3) <= (i + 1) * body // m
        questions = (row == QUERY).nonzero().flatten().tolist()
        assert len(questions) == m and questions[0] > needles[-1][0]
        asked = []
        for j, q in enumerate(questions):  # QUERY key END value, back to back up to the end of the sequence
            assert q == n - (m - j) * (k + 2 + d)
            key = tuple(row[q + 1 : q + 1 + k].tolist())
            assert row[q + 1 + k] == END and key in value_of
            assert tuple(row[q + 2 + k : q + 2 + k + d].tolist()) == value_of[key]  # its needle's value
            assert pos[j * d : (j + 1) * d].tolist() == list(range(q + 1 + k, q + 1 + k + d))
            asked.append(key)
        assert sorted(asked) == sorted(value_of)  # every key asked exactly once
        orders.add(tuple(sorted(value_of).index(key) for key in asked))
        # The labels are exactly the answered digits, and answer_positions point just before them.
        targets = (labels != -100).nonzero().flatten()
        assert torch.equal(targets, torch.sort(pos + 1).values)
        assert torch.equal(labels[targets], row[targets]) and (row[pos + 1] >= DIGIT0).all()
    assert len(orders) > 1  # the questions come in a random order
    again = NeedleTask(n, digits=d, needles=m, loss_on="answer", seed=4).batch(step=5, batch_size=3)
    for field in ("input_ids", "labels", "answer_positions"):
        assert torch.equal(getattr(again, field), getattr(b, field))  # a pure function of (seed, index)
    assert not torch.equal(task.batch(6, 3).input_ids, b.input_ids)
    assert not torch.equal(NeedleTask(n, digits=d, needles=m, seed=5).batch(5, 3).input_ids, b.input_ids)
    ids, first = task.sequence(5 * 3)  # sequence(): the ids and the position before the first answer
    assert torch.equal(ids, b.input_ids[0]) and first == int(b.answer_positions[0, 0])
    all_loss = NeedleTask(n, digits=d, needles=m, seed=4).batch(step=5, batch_size=3)
    assert torch.equal(all_loss.input_ids, b.input_ids) and torch.equal(all_loss.labels, b.input_ids)


def test_multi_needle_bad_settings_are_refused():
    NeedleTask(63, digits=2, needles=4)  # the shortest: no filler at all
    with pytest.raises(ValueError, match=r"too short for 4 needles.*need >= 63"):
        NeedleTask(62, digits=2, needles=4)
    with pytest.raises(ValueError, match="depth must be None"):
        NeedleTask(4096, needles=2, depth=0.5)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="needles must be an integer >= 1"):
            NeedleTask(4096, needles=bad)
    with pytest.raises(ValueError, match="distinct keys"):
        NeedleTask(4096, digits=1, key_tokens=1, filler_tokens=4, needles=5)
    row = NeedleTask(200, digits=1, key_tokens=1, filler_tokens=4, needles=4).batch(0, 1).input_ids[0]
    assert sorted(key for _, key, _ in _needles_of(row, 1, 1)) == [(14,), (15,), (16,), (17,)]  # all 4 keys


HAS_DOC_IDS = "doc_ids" in inspect.signature(oomb.chunked_backward).parameters


@pytest.mark.skipif(not HAS_DOC_IDS, reason="oomb.chunked_backward has no doc_ids argument yet (document "
                                            "masking in the engine, being added on main)")
def test_packing_with_document_masks_gives_the_gradients_of_separate_documents():
    torch.manual_seed(0)
    model = tiny_model("llama", vocab_size=300)
    lengths = [37, 60, 41, 54]  # crosses the 64-token chunk boundaries at odd places
    docs = [torch.randint(0, 256, (n,)) for n in lengths]
    ids = torch.cat(docs)[None]
    doc_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    labels = ids.clone()
    labels[0, 1:][doc_ids[0, 1:] != doc_ids[0, :-1]] = IGNORE_INDEX

    oomb.chunked_backward(model, ids, labels, chunk_size=64, page_size=32, doc_ids=doc_ids)
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    targets = sum(n - 1 for n in lengths)
    for doc in docs:  # each document alone, from position 0, its token losses summed
        logits = model(doc[None]).logits[0, :-1]
        (torch.nn.functional.cross_entropy(logits, doc[1:], reduction="sum") / targets).backward()
    for name, p in model.named_parameters():
        err = float((packed[name] - p.grad).norm() / p.grad.norm())
        assert err <= 1e-5, (name, err)
