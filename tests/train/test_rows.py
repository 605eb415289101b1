"""Reading data as it is needed (oomb/train/data/rows.py, windows.py): pieces, windows, positions, bounded memory."""

import itertools
import json
import tracemalloc

import pytest
import torch

from oomb.train.data.corpus import byte_level_tokenizer, find_sources
from oomb.train.data.packing import PackedCorpus
from oomb.train.data.rows import PIECE_CHARS, TextFile, open_rows, text_piece
from oomb.train.data.windows import RowStream, held_out


def _lines(n: int, width: int = 200) -> str:
    """``n`` numbered lines of ``width`` characters: every cut is visible, no line equals another."""
    return "".join(f"{i:09d} " + "xyz é "[i % 6] * (width - 11) + "\n" for i in range(n))


def _stream(corpus: PackedCorpus, sequences: int) -> list[int]:
    return torch.cat([corpus.next_sequence()[0] for _ in range(sequences)]).tolist()


def test_pieces_end_after_a_line_break_and_cover_the_text_once():
    text = _lines(3 * PIECE_CHARS // 200)
    pieces, start, last = [], 0, False
    while not last:
        piece, start, last = text_piece(text, start)
        pieces.append(piece)
    assert "".join(pieces) == text and len(pieces) == 4
    assert all(p.endswith("\n") and len(p) <= PIECE_CHARS for p in pieces)
    unbroken = "é" * (PIECE_CHARS + 10)  # no line break, no space: cut at the limit, by characters
    assert text_piece(unbroken, 0)[:2] == ("é" * PIECE_CHARS, PIECE_CHARS)


def test_a_text_file_larger_than_a_piece_is_packed_to_its_bytes_and_resumes_inside_a_piece(tmp_path):
    text = _lines(int(4.5 * PIECE_CHARS) // 200)
    path = tmp_path / "big.txt"
    path.write_text(text)
    data = path.read_bytes()
    assert TextFile(path).piece(0)[1] < len(data) and TextFile(path).piece(0)[0].endswith("\n")
    corpus = PackedCorpus(path, byte_level_tokenizer(), 4096)
    stream = _stream(corpus, len(data) // 4096 + 2)
    assert stream[: len(data)] == list(data) and stream[len(data)] == 256  # every byte once, then EOS
    assert bytes(stream[len(data) + 1 : len(data) + 101]) == data[:100]  # the next epoch: the file again

    straight = PackedCorpus(path, byte_level_tokenizer(), 4096)
    _stream(straight, 100)  # 400 KB in: inside the second piece
    state = json.loads(json.dumps(straight.state_dict()))
    assert state["piece"] > 0 and state["offset"] > 0
    resumed = PackedCorpus(path, byte_level_tokenizer(), 4096)
    resumed.load_state_dict(state)
    assert _stream(resumed, 400) == _stream(straight, 400)  # across the file's end


@pytest.mark.parametrize("window_rows", [5, 10_000])  # many windows, and the whole file in one
def test_jsonl_rows_resume_exactly_from_a_byte_position(tmp_path, window_rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}: " + "ab" * (i % 13)}) + ("\n\n" if i % 7 == 0 else "\n")
                            for i in range(80)))
    reader = open_rows(find_sources(path)[0])
    rows = list(reader)
    assert [r.number for r in rows] == list(range(80)) and rows[8].where == f"{path}:11"  # blank lines skipped
    mid = open_rows(find_sources(path)[0])
    first = list(itertools.islice(mid, 30))
    again = list(open_rows(find_sources(path)[0], position=json.loads(json.dumps(mid.position()))))
    assert [r.value for r in first + again] == [r.value for r in rows]

    straight = PackedCorpus(path, byte_level_tokenizer(), 32, seed=2, window_rows=window_rows)
    _stream(straight, 23)
    state = json.loads(json.dumps(straight.state_dict()))
    resumed = PackedCorpus(path, byte_level_tokenizer(), 32, seed=2, window_rows=window_rows)
    resumed.load_state_dict(state)
    assert _stream(resumed, 150) == _stream(straight, 150)  # past the end of the epoch
    assert straight.rows.epoch >= 1


def test_windows_shuffle_locally_and_visit_every_row_once_per_epoch(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": str(i)}) + "\n" for i in range(100)))
    stream = RowStream(find_sources(path), lambda source, at: open_rows(source, position=at), seed=4, window_rows=16)
    seen = []
    while stream.epoch == 0:
        seen.append(int(stream.current().value["text"]))
        stream.advance()
        stream.current()  # moves on to the next window, source or epoch
    assert sorted(seen) == list(range(100)) and seen != list(range(100))
    for w in range(6):  # rows stay in their window of 16: shuffled locally, never across windows
        assert sorted(seen[16 * w : 16 * w + 16]) == list(range(16 * w, 16 * w + 16))
    assert stream.window == 0 and stream.epoch == 1


def test_the_held_out_split_is_a_fixed_fraction_of_rows_chosen_by_file_and_row(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "x.jsonl").write_text("{}\n")
    (tmp_path / "b" / "x.jsonl").write_text("{}\n")
    (here,), (moved,) = find_sources(tmp_path / "a"), find_sources(tmp_path / "b")
    picked = [n for n in range(20_000) if held_out(here, n, 0.1)]
    assert 1800 < len(picked) < 2200  # ~10%
    assert picked == [n for n in range(20_000) if held_out(moved, n, 0.1)]  # the folder's name does not matter
    assert set(picked) <= {n for n in range(20_000) if held_out(here, n, 0.3)}  # a larger fraction holds out more


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_memory_while_packing_does_not_grow_with_the_corpus(tmp_path, kind):
    """Python's peak memory while the first batches are made: one window (or piece), whatever the file's size."""
    peaks, sizes = [], []
    for scale in (1, 4):
        path = tmp_path / f"corpus{scale}.{kind}"
        with open(path, "w") as f:
            for i in range(scale * 8000):  # ~8 MB and ~32 MB
                line = f"{i:09d} " + "the quick brown fox jumps over the lazy dog " * 23
                f.write(json.dumps({"text": line}) + "\n" if kind == "jsonl" else line + "\n")
        sizes.append(path.stat().st_size)
        tracemalloc.start()
        corpus = PackedCorpus(path, byte_level_tokenizer(), 4096, window_chars=1 << 20)
        for _ in range(3):
            corpus.batch(2)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert sizes[1] > 3.5 * sizes[0] > 25e6
    assert peaks[1] < 1.25 * peaks[0] + (256 << 10), peaks  # the same bound for a file four times the size
    assert peaks[1] < 8e6, peaks  # a window of ~1 MB of text, or a piece and its token ids: never the file
