"""Rows of one data source, read in order from a saved position; text files read a piece at a time.

Nothing here holds a source whole: a 50 GB file is read a line, a few rows or a piece at a
time, and a reader can start at any position it reported before::

    kind      a row                                 a position (JSON data: checkpoints hold it)
    text      the whole file, as a TextFile          {"row"}: 0 before it, 1 after
    jsonl     a non-empty line's JSON object         {"row", "line", "byte"}: a seek to the byte
    parquet   the wanted columns of a row           {"row"}: a seek to its row group
    dataset   the same (save_to_disk, memory-mapped) {"row"}
    stream    the same (datasets.load_dataset(..., streaming=True): hub ids, dataset folders)
                                                    {"row", "state"}: the IterableDataset's state_dict()

A text document is tokenized in pieces of about PIECE_CHARS characters, cut after a line
break (``TextFile.piece``, ``text_piece``): neither a large file nor a large JSON string
is ever tokenized, or held as token ids, in one go. Cuts depend on the text alone, so a
resumed run cuts where the first did.
"""

from __future__ import annotations

import atexit
import codecs
import os
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from oomb.train.config.bounded import TooDeep, loads_json, quoted
from oomb.train.data.corpus import DataError, Source, find_sources
from oomb.train.data.identity import check_file, check_folder

# ~64K tokens: one tokenizer call, whose Python list of ids (8 B a token) and int64 copy are the largest
# objects packing makes, whatever the document's size.
PIECE_CHARS = 1 << 18
_BATCH_ROWS = 64  # rows decoded at a time from parquet, a saved dataset or a stream


@dataclass(frozen=True)
class Row:
    value: object  # a TextFile (text sources), else a dict: the JSON object, or the wanted columns
    number: int  # the row's number in its source, from 0 (a .jsonl counts its non-empty lines)
    where: str  # for messages: "file:line", or "file row N" / "dataset row N"


@dataclass(frozen=True)
class TextFile:
    """A text file that is one document, read a piece at a time (``piece``)."""

    path: Path

    def piece(self, start: int) -> tuple[str, int, bool]:
        """The text from byte ``start``: about PIECE_CHARS bytes, cut after a line break; the byte after
        it; and whether the file ends there. A file the run watches that changed since it started is refused
        (oomb.train.data.identity)."""
        check_file(self.path)
        try:
            with open(self.path, "rb") as f:
                f.seek(start)
                data = f.read(PIECE_CHARS + 1)  # one byte more: does the file go on?
        except OSError as e:
            raise DataError(f"{self.path} cannot be read: {e}") from e
        last = len(data) <= PIECE_CHARS
        if not last:
            data = data[: _cut_bytes(data)]
        try:
            return data.decode("utf-8"), start + len(data), last
        except UnicodeDecodeError as e:
            changed = " (the file changed since the run started)"
            raise DataError(not_utf8(self.path, start + e.start, e) + changed) from e


def _cut_bytes(data: bytes) -> int:
    """Where to end a piece of ``data[:PIECE_CHARS]``: after its last line break or space in the second
    half, else before the character that crosses the limit (a UTF-8 boundary)."""
    block = data[:PIECE_CHARS]
    for mark in (b"\n", b" "):
        at = block.rfind(mark)
        if at >= PIECE_CHARS // 2:
            return at + 1
    end = PIECE_CHARS
    while end > 0 and data[end] & 0xC0 == 0x80:  # a continuation byte: the character started before
        end -= 1
    return end


def text_piece(text: str, start: int) -> tuple[str, int, bool]:
    """``TextFile.piece`` for a document held as a string: the piece from character ``start``."""
    if len(text) - start <= PIECE_CHARS:
        return text[start:], len(text), True
    block = text[start : start + PIECE_CHARS]
    for mark in ("\n", " "):
        at = block.rfind(mark)
        if at >= PIECE_CHARS // 2:
            return block[: at + 1], start + at + 1, False
    return block, start + PIECE_CHARS, False


def not_utf8(path: Path, byte: int, error: UnicodeDecodeError) -> str:
    bad = error.object[error.start:error.start + 1]
    return (f"{path} is not UTF-8 text: byte {byte} is {bad!r}; save it as UTF-8 (e.g. iconv -f latin1 -t "
            "utf-8) or leave it out of data.paths")


# --- readers ---------------------------------------------------------------------------------------


class _TextRows:
    def __init__(self, source: Source, position: dict | None) -> None:
        self.source, self.columns = source, None
        self._row = int((position or {}).get("row", 0))

    def position(self) -> dict:
        return {"row": self._row}

    def __iter__(self) -> Iterator[Row]:
        if self._row == 0:
            self._row = 1
            yield Row(TextFile(self.source.path), 0, str(self.source.path))


class _JsonlRows:
    def __init__(self, source: Source, position: dict | None) -> None:
        self.source, self.columns = source, None
        p = position or {}
        self._row, self._line, self._byte = int(p.get("row", 0)), int(p.get("line", 0)), int(p.get("byte", 0))

    def position(self) -> dict:
        return {"row": self._row, "line": self._line, "byte": self._byte}

    def __iter__(self) -> Iterator[Row]:
        path = self.source.path
        try:
            f = open(path, "rb")  # noqa: SIM115 - held open across yields, closed by the with below
        except OSError as e:
            raise DataError(f"{path} cannot be read: {e}") from e
        with f:
            check_file(path, os.fstat(f.fileno()))  # a file the run watches, changed since it started: refused
            f.seek(self._byte)
            for raw in f:
                check_file(path, os.fstat(f.fileno()))  # rows appended or rewritten while it is read too
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(not_utf8(path, self._byte + e.start, e) + f" (line {self._line + 1})") from e
                self._line, self._byte = self._line + 1, self._byte + len(raw)
                if not line.strip():
                    continue
                try:
                    record = loads_json(line)  # nested deeper than bounded.MAX_DEPTH: refused, never parsed
                except TooDeep as e:
                    raise DataError(f"{path}:{self._line}: {e}; fix or remove that line") from None
                except ValueError as e:  # json.JSONDecodeError
                    raise DataError(f"{path}:{self._line} is not valid JSON: {e}") from e
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{self._line} holds a JSON {type(record).__name__}, not an object")
                self._row += 1
                yield Row(record, self._row - 1, f"{path}:{self._line}")


class _TableRows:
    """Rows of a columnar source (parquet, saved dataset, stream), the wanted columns, a few at a time."""

    def __init__(self, source: Source, position: dict | None, wanted: Sequence[str]) -> None:
        self.source, self.wanted = source, list(wanted)
        self._row = int((position or {}).get("row", 0))
        self._state = (position or {}).get("state")
        self._table = self._open()

    def position(self) -> dict:
        if self.source.kind == "stream":
            return {"row": self._row, "state": self._table.state_dict()}
        return {"row": self._row}

    def _open(self):
        kind, path = self.source.kind, self.source.path
        if kind == "parquet":
            import pyarrow.parquet as pq

            check_file(path)
            table = pq.ParquetFile(path)
            self.columns = table.schema_arrow.names
            return table
        if kind == "dataset":
            import datasets

            check_folder(path)  # its arrow files
            table = datasets.load_from_disk(str(path))
            if isinstance(table, datasets.DatasetDict):
                raise DataError(f"{path} holds a DatasetDict with splits {list(table)}; name one split's folder "
                                f"(e.g. {path}/train)")
            self.columns = table.column_names
            return table
        table = open_stream(self.source)
        self.columns = table.column_names  # None where the stream's features are not known before reading
        if self.columns is not None:
            table = table.select_columns(self._columns())
        if self._state is not None:  # on the dataset as it is iterated: a state is only valid there
            table.load_state_dict(self._state)
        return table

    def _columns(self) -> list[str]:
        return [c for c in self.wanted if self.columns is None or c in self.columns]

    def _batches(self) -> Iterator[list[dict]]:
        kind, columns = self.source.kind, self._columns()
        if kind == "parquet":  # from the row group holding the position, its leading rows skipped
            meta, first, skip = self._table.metadata, 0, self._row
            while first < meta.num_row_groups and skip >= meta.row_group(first).num_rows:
                skip -= meta.row_group(first).num_rows
                first += 1
            groups = list(range(first, meta.num_row_groups))
            if not groups:
                return
            for batch in self._table.iter_batches(batch_size=_BATCH_ROWS, row_groups=groups, columns=columns):
                rows = batch.to_pylist()
                yield rows[skip:]
                skip = max(0, skip - len(rows))
        elif kind == "dataset":
            table = self._table.select_columns(columns)
            for start in range(self._row, len(table), _BATCH_ROWS):
                yield _as_rows(table[start : start + _BATCH_ROWS])
        else:
            for row in self._table:  # the stream's state advances row by row
                yield [row if self.columns is not None else {c: row[c] for c in self.wanted if c in row}]

    def __iter__(self) -> Iterator[Row]:
        rows = self._rows()
        if self.source.kind == "stream":
            _open_streams.add(rows)
        return rows

    def _rows(self) -> Iterator[Row]:
        name = self.source.name
        try:
            for rows in self._batches():
                for value in rows:
                    self._row += 1
                    yield Row(value, self._row - 1, f"{name} row {self._row - 1}")
        except DataError:
            raise
        except (OSError, ValueError) as e:  # pyarrow's and datasets' errors for a damaged file or stream
            raise DataError(f"{name} cannot be read: {type(e).__name__}: {e}") from e


# Streams being read: closed at exit, while the modules they use still exist (a stream left suspended
# in its generator is otherwise finalized during interpreter shutdown, which prints errors).
_open_streams: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_streams() -> None:
    for rows in list(_open_streams):
        rows.close()


def _as_rows(columns: dict[str, list]) -> list[dict]:
    names = list(columns)
    return [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def open_rows(source: Source, wanted: Sequence[str] = (), position: dict | None = None):
    """A reader of ``source``'s rows from ``position`` (None: its first row): iterating gives Rows, and
    ``position()`` is where the row after the last one given starts; ``columns`` lists the source's
    columns (None for text and .jsonl files, whose rows say). ``wanted``: the columns to read."""
    try:
        if source.kind == "text":
            return _TextRows(source, position)
        if source.kind == "jsonl":
            return _JsonlRows(source, position)
        return _TableRows(source, position, wanted)
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"{source.name} cannot be read: {type(e).__name__}: {e}") from e


def open_stream(source: Source):
    """``datasets.load_dataset(..., streaming=True)`` of a stream source; DataError says what was tried."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    from oomb.train.config.hub import not_reachable

    ref = source.ref
    try:
        return datasets.load_dataset(ref.name, ref.config, split=ref.split, streaming=True, revision=ref.revision)
    except DatasetNotFoundError as e:
        raise DataError(f"{ref}: no local path {Path(ref.name).absolute()}, and {e} (private or gated datasets "
                        "need a login: hf auth login, or HF_TOKEN)") from None
    except ConnectionError as e:
        raise DataError(f"{ref}: {not_reachable(ref.name, 'dataset', e)}") from None
    except (ValueError, FileNotFoundError) as e:  # a missing split or config: datasets names those there are
        where = f"the dataset folder {ref.name}" if Path(ref.name).is_dir() else f"the hub dataset {ref.name}"
        raise DataError(f"{ref}: {where}: {str(e).strip().splitlines()[0]}") from None


# --- text documents --------------------------------------------------------------------------------


def text_of(row: Row, field: str) -> str | TextFile:
    """The document a row holds for data.task=text: a text file, or the row's ``field``, checked."""
    if isinstance(row.value, TextFile):
        return row.value
    if field not in row.value:
        raise DataError(f"{row.where} has no field {field!r} (it has {quoted(list(row.value))}); set data.text_field")
    text = row.value[field]
    if not isinstance(text, str):
        raise DataError(f"{row.where}: the text field holds {type(text).__name__}, not a string")
    return text


def open_text_rows(source: Source, field: str, position: dict | None = None):
    """``open_rows`` for data.task=text: a columnar source without ``field`` is refused by name."""
    reader = open_rows(source, [field], position)
    if reader.columns is not None and field not in reader.columns:
        raise DataError(f"{source.name} has no column {field!r} (columns: {reader.columns}); set data.text_field")
    return reader


def check_sources(sources: Sequence[Source], text_field: str = "text") -> None:
    """Read every local source once, keeping nothing, so a bad file is named before training starts.

    A run reads its sources lazily: without this pass a file that is not UTF-8, not readable,
    or has a row without text would stop the run hours in. A stream (hub id, dataset folder)
    is opened and its first row checked: reading it all would download it all. Raises
    DataError naming the file and the byte, line or row.
    """
    for source in sources:
        if source.kind == "text":
            _check_utf8(source.path)
            continue
        for row in open_text_rows(source, text_field):
            text_of(row, text_field)
            if source.kind == "stream":
                break


def _check_utf8(path: Path, block: int = 1 << 20) -> None:
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes of the file before ``data``
    try:
        with open(path, "rb") as f:
            while data := f.read(block):
                pending = len(decoder.getstate()[0])  # bytes of a character cut by the previous block
                try:
                    decoder.decode(data)
                except UnicodeDecodeError as e:
                    raise DataError(not_utf8(path, offset - pending + e.start, e)) from e
                offset += len(data)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text: it ends inside a character (byte {offset}); save it as UTF-8 "
                        "or leave it out of data.paths") from e
    except OSError as e:
        raise DataError(f"{path} cannot be read: {e}") from e


def iter_documents(paths: str | Path | Sequence[str | Path], text_field: str = "text") -> Iterator[str]:
    """Every document of ``paths`` as a string, sources in ``find_sources`` order, rows in source order.

    All paths are checked before the first document is yielded; a text file comes whole.
    """
    for source in find_sources(paths):
        for row in open_text_rows(source, text_field):
            text = text_of(row, text_field)
            if isinstance(text, TextFile):
                try:
                    text = text.path.read_text(encoding="utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(not_utf8(source.path, e.start, e)) from e
                except OSError as e:
                    raise DataError(f"{source.path} cannot be read: {e}") from e
            yield text
