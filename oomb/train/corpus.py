"""Text from local files and the tokenizer that turns it into ids.

Sources (``iter_documents`` / ``find_sources``) — a file, a folder or a glob pattern::

    notes.txt, README.md      one document per file (the whole text)
    data.jsonl                one document per line: the JSON object's ``text_field``
    data.parquet              one document per row: the column ``text_field`` (pyarrow)
    saved/  (save_to_disk)    one document per row of a ``datasets.Dataset`` folder

A file named explicitly is read whatever its suffix: an unknown one (``main.py``,
``notes.rst``) is one text document. A folder is searched recursively, and a glob pattern
filtered, for the known suffixes and the ones ``find_sources`` is given (``data.suffixes``),
sorted by path so the order never depends on the file system; a folder that
``datasets.Dataset.save_to_disk`` wrote is read as one dataset. Nothing is downloaded.

Tokenizers (``load_tokenizer``): the folder's own through transformers' AutoTokenizer
(local files only, never remote code); a folder without tokenizer files gets the
byte-level tokenizer, whose 257 ids are the 256 byte values and an end-of-text token.
"""

from __future__ import annotations

import codecs
import glob
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
# Files that mark a folder written by datasets.Dataset.save_to_disk.
_DATASET_MARKERS = ("dataset_info.json", "state.json")
# Files whose presence means a model folder carries its own tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
BYTE_EOS = "<|endoftext|>"


class DataError(ValueError):
    """Data that cannot be read; the message names the path and what to change."""


@dataclass(frozen=True)
class Source:
    """One readable unit of documents: a file, or a saved ``datasets`` folder (kind "dataset")."""

    path: Path
    kind: str  # "text", "jsonl", "parquet" or "dataset"


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and all((path / m).is_file() for m in _DATASET_MARKERS)


def _kind_of_file(path: Path) -> str:
    """The reader of a file: by its suffix, and text for any suffix oomb does not know (source code, .rst, ...)."""
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text"


def _sources_in_dir(folder: Path, suffixes: tuple[str, ...]) -> list[Source]:
    if _is_saved_dataset(folder):
        return [Source(folder, "dataset")]
    found: list[Source] = []
    for child in sorted(folder.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            found.extend(_sources_in_dir(child, suffixes))
        elif child.suffix.lower() in suffixes:
            found.append(Source(child, _kind_of_file(child)))
    return found


def find_sources(paths: str | Path | Sequence[str | Path],
                 text_suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Source]:
    """Every data source named by ``paths`` (files, folders, glob patterns), in a fixed order.

    A named file is taken whatever its suffix; folders and glob patterns take the files whose
    suffix is in ``text_suffixes`` (lower case, with the dot) or is .jsonl/.parquet, and saved
    datasets. Raises DataError for a path that does not exist, a glob that matches nothing, or a
    folder or pattern holding no such file.
    """
    if isinstance(paths, str | Path):
        paths = [paths]
    if not paths:
        raise DataError("no data paths given; set data.paths to files, folders or glob patterns")
    suffixes = tuple(text_suffixes) + JSONL_SUFFIXES + PARQUET_SUFFIXES
    known = f"{', '.join(suffixes)} file"
    more = " (data.suffixes lists more suffixes for text, e.g. data.suffixes=[.py])" if text_suffixes else ""
    sources: list[Source] = []
    for raw in paths:
        text = str(raw)
        if glob.has_magic(text):
            matches = sorted(Path(m) for m in glob.glob(text, recursive=True))
            if not matches:
                raise DataError(f"data path pattern {text!r} matches no file")
            before = len(sources)
            for m in matches:
                if m.is_dir():
                    sources.extend(_sources_in_dir(m, suffixes))
                elif m.suffix.lower() in suffixes:
                    sources.append(Source(m, _kind_of_file(m)))
            if len(sources) == before:
                raise DataError(f"data path pattern {text!r} matches no {known}{more}")
            continue
        path = Path(text).expanduser()
        if not path.exists():
            raise DataError(f"data path {path} does not exist")
        if path.is_dir():
            found = _sources_in_dir(path, suffixes)
            if not found:
                raise DataError(f"data folder {path} holds no {known} and is not a folder saved with datasets' "
                                f"save_to_disk{more}")
            sources.extend(found)
        else:
            sources.append(Source(path, _kind_of_file(path)))
    return sources


def check_sources(sources: Sequence[Source], text_field: str = "text") -> None:
    """Read every source once, keeping nothing, so a bad file is named before training starts.

    A run reads its sources lazily, one at a time: without this pass a file that is not UTF-8,
    not readable, or has a row without text would stop the run hours in. Raises DataError
    naming the file and the byte, line or row.
    """
    for source in sources:
        if source.kind == "text":
            _check_utf8(source.path)
        else:  # jsonl, parquet, dataset: every row is parsed and its text field checked
            for _ in _documents(source, text_field):
                pass


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
                    raise DataError(_not_utf8(path, offset - pending + e.start, e)) from e
                offset += len(data)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text: it ends inside a character (byte {offset}); save it as UTF-8 "
                        "or leave it out of data.paths") from e
    except OSError as e:
        raise DataError(f"{path} cannot be read: {e}") from e


def _not_utf8(path: Path, byte: int, error: UnicodeDecodeError) -> str:
    bad = error.object[error.start:error.start + 1]
    return (f"{path} is not UTF-8 text: byte {byte} is {bad!r}; save it as UTF-8 (e.g. iconv -f latin1 -t "
            "utf-8) or leave it out of data.paths")


def read_documents(source: Source, text_field: str = "text") -> Sequence[str]:
    """All documents of one source as an indexable sequence (a saved dataset stays memory-mapped)."""
    if source.kind == "dataset":
        return _DatasetColumn(_open_dataset(source, text_field), text_field)
    return list(_documents(source, text_field))


def _documents(source: Source, text_field: str) -> Iterator[str]:
    """The documents of one source in file order; DataError names the file (and line or row) of a bad one."""
    try:
        yield from _read(source, text_field)
    except DataError:
        raise
    except UnicodeDecodeError as e:
        raise DataError(_not_utf8(source.path, e.start, e)) from e
    except (OSError, ValueError) as e:  # also pyarrow's and datasets' errors for a damaged file
        raise DataError(f"{source.path} cannot be read: {type(e).__name__}: {e}") from e


def _read(source: Source, text_field: str) -> Iterator[str]:
    if source.kind == "text":
        yield source.path.read_text(encoding="utf-8")
        return
    if source.kind == "jsonl":
        with open(source.path, "rb") as f:
            offset = 0
            for number, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(_not_utf8(source.path, offset + e.start, e) + f" (line {number})") from e
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{source.path}:{number} is not valid JSON: {e}") from e
                if not isinstance(record, dict) or text_field not in record:
                    keys = list(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"{source.path}:{number} has no field {text_field!r} (it has {keys}); "
                                    "set data.text_field")
                yield _as_text(record[text_field], f"{source.path}:{number}")
        return
    if source.kind == "parquet":
        import pyarrow.parquet as pq

        schema = pq.read_schema(source.path)
        if text_field not in schema.names:
            raise DataError(f"{source.path} has no column {text_field!r} (columns: {schema.names}); "
                            "set data.text_field")
        column = pq.read_table(source.path, columns=[text_field]).column(text_field)
        for i, v in enumerate(column.to_pylist()):
            yield _as_text(v, f"{source.path} row {i}")
        return
    if source.kind == "dataset":
        column = _DatasetColumn(_open_dataset(source, text_field), text_field)
        for i in range(len(column)):
            yield column[i]
        return
    raise AssertionError(source.kind)


def _open_dataset(source: Source, text_field: str):
    import datasets

    ds = datasets.load_from_disk(str(source.path))
    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{source.path} holds a DatasetDict with splits {list(ds)}; "
                        f"name one split's folder (e.g. {source.path}/train)")
    if text_field not in ds.column_names:
        raise DataError(f"{source.path} has no column {text_field!r} (columns: {ds.column_names}); "
                        "set data.text_field")
    return ds


class _DatasetColumn(Sequence):
    """One text column of a memory-mapped ``datasets.Dataset``, read a row at a time."""

    def __init__(self, ds, field: str) -> None:
        self._ds, self._field = ds, field

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return _as_text(self._ds[int(index)][self._field], f"{self._ds.cache_files} row {index}")


def _as_text(value, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: the text field holds {type(value).__name__}, not a string")
    return value


def iter_documents(paths: str | Path | Sequence[str | Path], text_field: str = "text") -> Iterator[str]:
    """Every document of ``paths`` as a string, sources in ``find_sources`` order, rows in file order.

    All paths are checked before the first document is yielded.
    """
    sources = find_sources(paths)
    for source in sources:
        yield from read_documents(source, text_field)


# --- tokenizers -----------------------------------------------------------------------------------


def has_tokenizer(folder: str | Path) -> bool:
    folder = Path(folder)
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def _bytes_to_unicode() -> dict[int, str]:
    """Byte value -> the printable character byte-level BPE uses for it (the GPT-2 convention)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_level_tokenizer():
    """A transformers tokenizer with id = byte value (0-255) and ``<|endoftext|>`` = 256.

    Built from the ``tokenizers`` library (byte-level pre-tokenizer, BPE without merges), so
    it saves and loads like any other tokenizer and goes into the export.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab[BYTE_EOS] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=BYTE_EOS, model_max_length=2**62)


def load_tokenizer(path: str | Path | None):
    """The tokenizer of a model or tokenizer folder; the byte-level tokenizer when it has none.

    ``None`` (a built-in preset, no folder) also gives the byte-level tokenizer. A folder with
    tokenizer files that transformers cannot load is an error, never silently replaced.
    """
    if path is None:
        return byte_level_tokenizer()
    folder = Path(path)
    if not folder.is_dir():
        raise DataError(f"tokenizer folder {folder} does not exist")
    if not has_tokenizer(folder):
        return byte_level_tokenizer()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many types (OSError, ValueError, ...) for a broken folder
        raise DataError(f"cannot load the tokenizer in {folder}: {e}") from e


def tokenizer_vocab_size(tokenizer) -> int:
    """Ids the tokenizer can produce: its base vocabulary plus added tokens."""
    return len(tokenizer)


def check_tokenizer_fits(tokenizer, model_vocab: int, where: str = "the tokenizer") -> None:
    """Raise DataError when the tokenizer can produce ids the model's embedding does not have."""
    n = tokenizer_vocab_size(tokenizer)
    if n > model_vocab:
        byte = getattr(tokenizer, "eos_token", None) == BYTE_EOS and n == 257
        hint = ("it is oomb's byte-level tokenizer, used when the model comes without tokenizer files (a preset, "
                "or a folder without them); give a tokenizer with data.tokenizer=PATH or use a model with >= 257 ids"
                if byte else "use the tokenizer the model was trained with (data.tokenizer=PATH)")
        raise DataError(f"{where} has {n} ids but the model's embedding has only {model_vocab} rows: {hint}")
