"""Where documents come from (``find_sources``) and the tokenizer that turns them into ids.

Sources — a file, a folder, a glob pattern, or a dataset to stream::

    notes.txt, README.md      one document per file (the whole text)
    data.jsonl                one document per line: the JSON object's ``text_field``
    data.parquet              one document per row: the column ``text_field`` (pyarrow)
    saved/  (save_to_disk)    one document per row of a ``datasets.Dataset`` folder
    owner/name[:config][:split]   a Hugging Face hub dataset, streamed (oomb.train.config.hub)
    ./folder:split            a local dataset repository, streamed the same way

A file named explicitly is read whatever its suffix: an unknown one (``main.py``,
``notes.rst``) is one text document. A folder is searched recursively, and a glob pattern
filtered, for the known suffixes and the ones ``find_sources`` is given (``data.suffixes``),
sorted by path so the order never depends on the file system; a folder that
``datasets.Dataset.save_to_disk`` wrote is read as one dataset. A name that is no local
path is tried as a hub dataset id. oomb.train.data.rows reads the sources.

Tokenizers (``load_tokenizer``): the folder's own through transformers' AutoTokenizer
(local files only, never remote code); a folder without tokenizer files gets the
byte-level tokenizer, whose 257 ids are the 256 byte values and an end-of-text token.
"""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from oomb.train.config.hub import DatasetRef, looks_local, parse_dataset_ref

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
    """One readable unit of documents: a file, a saved ``datasets`` folder, or a dataset to stream.

    ``kind``: "text", "jsonl", "parquet", "dataset" (save_to_disk) or "stream" (``ref``: a hub id or
    a dataset repository folder, read through ``datasets.load_dataset(..., streaming=True)``).
    ``key`` names it the same wherever the data lies: its path below the data path that found it
    (the file's name for a named file), or the stream's reference (what a held-out split hashes).
    """

    path: Path
    kind: str
    key: str = ""
    ref: DatasetRef | None = None

    @property
    def name(self) -> str:
        """What messages call it: its path, or the stream's reference."""
        return str(self.ref) if self.ref is not None else str(self.path)


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


def _file(path: Path, root: Path | None) -> Source:
    key = path.relative_to(root).as_posix() if root is not None else path.name
    return Source(path, _kind_of_file(path), key)


def _sources_in_dir(folder: Path, suffixes: tuple[str, ...], root: Path) -> list[Source]:
    if _is_saved_dataset(folder):
        return [Source(folder, "dataset", folder.relative_to(root).as_posix() if folder != root else folder.name)]
    found: list[Source] = []
    for child in sorted(folder.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            found.extend(_sources_in_dir(child, suffixes, root))
        elif child.suffix.lower() in suffixes:
            found.append(_file(child, root))
    return found


def find_sources(paths: str | Path | Sequence[str | Path],
                 text_suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Source]:
    """Every data source named by ``paths`` (files, folders, glob patterns, datasets), in a fixed order.

    A named file is taken whatever its suffix; folders and glob patterns take the files whose
    suffix is in ``text_suffixes`` (lower case, with the dot) or is .jsonl/.parquet, and saved
    datasets. A name that is no local path but a hub dataset id, or a local folder followed by
    ``:split``, is a stream (nothing is read here). Raises DataError for a path that does not
    exist, a glob that matches nothing, or a folder or pattern holding no such file.
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
                    sources.extend(_sources_in_dir(m, suffixes, m.parent))
                elif m.suffix.lower() in suffixes:
                    sources.append(_file(m, None))
            if len(sources) == before:
                raise DataError(f"data path pattern {text!r} matches no {known}{more}")
            continue
        path = Path(text).expanduser()
        if not path.exists():
            ref = parse_dataset_ref(text)
            if ref is None:
                hub = "" if looks_local(text) else (" (nor is it a Hugging Face hub dataset id such as owner/name "
                                                    "or owner/name:split)")
                raise DataError(f"data path {path} does not exist ({path.absolute()}){hub}")
            sources.append(Source(Path(ref.name), "stream", str(ref), ref))
        elif path.is_dir():
            found = _sources_in_dir(path, suffixes, path)
            if not found:
                raise DataError(f"data folder {path} holds no {known} and is not a folder saved with datasets' "
                                f"save_to_disk{more}")
            sources.extend(found)
        else:
            sources.append(_file(path, None))
    return sources


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
