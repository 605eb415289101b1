"""Long documents of real text from the Python sources (code and docstrings) of installed packages; no download.

    python -m benchmarks.studies.code_corpus --out DIR                                  # the study's corpus
    python -m benchmarks.studies.code_corpus --out /tmp/cc --packages email --held-out json --vocab 512 \\
        --max-bytes 200000 --doc-tokens 4096                                             # seconds, any machine

Repository-level code corpora are built this way: a package's ``.py`` files concatenated in path order, a header
line naming each file (``# file: torch/_inductor/ir.py``). A document is a run of whole files of one package in
path order: it ends at the first boundary between two top-level subpackages (``torch/_inductor`` ->
``torch/_numpy``) once it holds ``--doc-tokens`` tokens, or at any file boundary once it holds twice that, and a
package's last piece shorter than ``--doc-tokens`` joins the document before it. So every document holds at least
``--doc-tokens`` tokens (counted file by file, within a few tokens of the whole text's count), unless its whole
package holds fewer. The default, 1,100,000, lets `oomb eval --ppl-length 1M` score any document.

Split BY PACKAGE: ``--held-out`` packages (default: jax and torch_geometric, those installed) are never trained on,
not even by the tokenizer. DIR gets:

    train/<package>.jsonl, heldout/<package>.jsonl   one document a line: {"text", "package", "first_file",
                                                     "last_file", "files", "tokens"}; `oomb train
                                                     data.task=text data.paths=[DIR/train]` reads them as they are
    tokenizer/                                       byte-level BPE (`tokenizers`) trained on ``--tokenizer-bytes``
                                                     of the training packages' files (a sample drawn by hash of
                                                     each file's path and the seed), saved as a transformers
                                                     PreTrainedTokenizerFast (tokenizer.json):
                                                     data.tokenizer=DIR/tokenizer
    corpus.json                                      packages and versions, files, bytes, documents and tokens per
                                                     package and split, the tokenizer's vocabulary, the seed, the
                                                     command and each output file's sha256

The same packages, settings and seed give the same bytes (files in sorted path order; the tokenizer's training is
deterministic: tested). Files that are not UTF-8, and symbolic links, are skipped and counted. ``--max-bytes`` caps
each package (its first files in path order, for tests).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PACKAGES = ("transformers", "torch", "triton", "numpy", "sympy", "networkx")
DEFAULT_HELD_OUT = ("jax", "torch_geometric")
EOS = "<|endoftext|>"
ENCODE_BATCH = 256  # files per tokenizers.encode_batch call (only the lengths are kept)


@dataclass
class SourceFile:
    rel: str  # path below site-packages, e.g. "torch/_inductor/ir.py"
    subtree: str  # its top-level subpackage, e.g. "torch/_inductor" ("torch" for the package's own modules)
    text: str  # the header line, then the file, ending in a newline
    tokens: int = 0


def package_root(name: str) -> Path | None:
    """The folder of an installed package (found without importing it); None where there is none."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def package_version(name: str) -> str | None:
    """The installed distribution's version; the Python version for the standard library; None if unknown."""
    dists = importlib.metadata.packages_distributions().get(name, [])
    for dist in dists or [name]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    if name in getattr(sys, "stdlib_module_names", ()):
        return f"python {platform.python_version()}"
    return None


def read_package(name: str, root: Path, max_bytes: int | None) -> tuple[list[SourceFile], dict]:
    """The package's .py files in sorted path order (up to ``max_bytes`` of them) and what was skipped."""
    files: list[SourceFile] = []
    skipped = {"not_utf8": 0, "symlinks": 0}
    total = 0
    paths = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    for path in paths:
        if max_bytes is not None and total >= max_bytes:
            break
        if path.is_symlink():  # (rglob does not enter linked folders)
            skipped["symlinks"] += 1
            continue
        try:
            body = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            skipped["not_utf8"] += 1
            continue
        rel_parts = (name, *path.relative_to(root).parts)
        rel = "/".join(rel_parts)
        subtree = "/".join(rel_parts[:2]) if len(rel_parts) > 2 else name
        text = f"# file: {rel}\n{body}" + ("" if body.endswith("\n") or not body else "\n")
        files.append(SourceFile(rel, subtree, text))
        total += len(text.encode("utf-8"))
    return files, skipped


def tokenizer_sample(files: list[SourceFile], max_bytes: int, seed: int) -> list[str]:
    """Training files for the tokenizer: in the order of a hash of (seed, path), until ``max_bytes``."""
    order = sorted(files, key=lambda f: hashlib.sha256(f"{seed}:{f.rel}".encode()).hexdigest())
    sample, total = [], 0
    for f in order:
        if total >= max_bytes:
            break
        sample.append(f.text)
        total += len(f.text.encode("utf-8"))
    return sample


def train_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE (GPT-2's pre-tokenizer, no prefix space) with ``<|endoftext|>``, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, model_max_length=2**62)


def count_tokens(tokenizer, files: list[SourceFile]) -> None:
    backend = tokenizer.backend_tokenizer
    for i in range(0, len(files), ENCODE_BATCH):
        batch = files[i:i + ENCODE_BATCH]
        for f, enc in zip(batch, backend.encode_batch([f.text for f in batch], add_special_tokens=False),
                          strict=True):
            f.tokens = len(enc.ids)


def documents(files: list[SourceFile], doc_tokens: int) -> list[list[SourceFile]]:
    """Runs of whole files in path order: closed at a subtree boundary once ``doc_tokens`` long, at any file boundary
    once twice that; a last run shorter than ``doc_tokens`` joins the one before."""
    docs: list[list[SourceFile]] = []
    current: list[SourceFile] = []
    n = 0
    for f in files:
        if current and (n >= 2 * doc_tokens or (n >= doc_tokens and f.subtree != current[-1].subtree)):
            docs.append(current)
            current, n = [], 0
        current.append(f)
        n += f.tokens
    if current:
        if docs and n < doc_tokens:
            docs[-1].extend(current)
        else:
            docs.append(current)
    return docs


def write_split(folder: Path, package: str, docs: list[list[SourceFile]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{package}.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for doc in docs:
            row = {"text": "".join(f.text for f in doc), "package": package, "first_file": doc[0].rel,
                   "last_file": doc[-1].rel, "files": len(doc), "tokens": sum(f.tokens for f in doc)}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def build(out: Path, packages=DEFAULT_PACKAGES, held_out=DEFAULT_HELD_OUT, vocab: int = 16384,
          max_bytes: int | None = None, doc_tokens: int = 1_100_000, tokenizer_bytes: int = 32_000_000,
          seed: int = 0, command: str | None = None) -> dict:
    """Build the corpus into ``out`` (which must be empty or absent); returns (and writes) its description."""
    t0 = time.perf_counter()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} already holds files; give an empty or new folder")
    overlap = sorted(set(packages) & set(held_out))
    if overlap:
        raise ValueError(f"{', '.join(overlap)}: a package is either trained on or held out, not both")
    split_of = {**{p: "train" for p in packages}, **{p: "heldout" for p in held_out}}
    found, missing = {}, []
    for name in split_of:
        root = package_root(name)
        if root is None:
            missing.append(name)
        else:
            found[name] = root
    for split in ("train", "heldout"):
        if not any(split_of[p] == split for p in found):
            names = [p for p in split_of if split_of[p] == split]
            raise ValueError(f"none of the {split} packages ({', '.join(names)}) is installed here; name installed "
                             "ones with --packages / --held-out")
    read = {name: read_package(name, root, max_bytes) for name, root in found.items()}
    train_files = [f for name in found if split_of[name] == "train" for f in read[name][0]]
    sample = tokenizer_sample(train_files, tokenizer_bytes, seed)
    t_tok = time.perf_counter()
    tokenizer = train_tokenizer(sample, vocab)
    t_tok = time.perf_counter() - t_tok
    tokenizer.save_pretrained(str(out / "tokenizer"))
    rows, hashes = [], {}
    for name in found:
        files, skipped = read[name]
        count_tokens(tokenizer, files)
        docs = documents(files, doc_tokens)
        path = write_split(out / split_of[name], name, docs)
        hashes[path.relative_to(out).as_posix()] = sha256_file(path)
        rows.append({"name": name, "split": split_of[name], "version": package_version(name), "root": str(found[name]),
                     "files": len(files), "skipped_files": skipped,
                     "bytes": sum(len(f.text.encode("utf-8")) for f in files), "tokens": sum(f.tokens for f in files),
                     "documents": len(docs), "document_tokens": [sum(f.tokens for f in d) for d in docs]})
    splits = {}
    for split in ("train", "heldout"):
        mine = [r for r in rows if r["split"] == split]
        splits[split] = {"path": split, "packages": [r["name"] for r in mine],
                         **{k: sum(r[k] for r in mine) for k in ("files", "bytes", "tokens", "documents")},
                         "documents_of_at_least_doc_tokens": sum(t >= doc_tokens for r in mine
                                                                 for t in r["document_tokens"])}
    description = {
        "builder": "benchmarks.studies.code_corpus", "command": command, "seed": seed, "doc_tokens": doc_tokens,
        "max_bytes_per_package": max_bytes, "python": platform.python_version(), "packages": rows,
        "missing_packages": missing, "splits": splits,
        "tokenizer": {"path": "tokenizer", "kind": "byte-level BPE (tokenizers), PreTrainedTokenizerFast",
                      "vocab_requested": vocab, "vocab_size": len(tokenizer), "eos_token": EOS,
                      "trained_on_files": len(sample), "trained_on_bytes": sum(len(t.encode("utf-8")) for t in sample),
                      "train_seconds": round(t_tok, 1)},
        "sha256": hashes, "seconds": round(time.perf_counter() - t0, 1),
    }
    (out / "corpus.json").write_text(json.dumps(description, indent=1) + "\n")
    return description


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.code_corpus", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="an empty or new folder")
    p.add_argument("--packages", type=_names, default=DEFAULT_PACKAGES,
                   help=f"training packages, comma-separated import names (default {','.join(DEFAULT_PACKAGES)}; "
                        "those not installed are skipped and listed)")
    p.add_argument("--held-out", type=_names, default=DEFAULT_HELD_OUT,
                   help=f"held-out packages (default {','.join(DEFAULT_HELD_OUT)})")
    p.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary, <|endoftext|> included (default 16384)")
    p.add_argument("--max-bytes", type=int, default=None, help="at most this many bytes of each package (default all)")
    p.add_argument("--doc-tokens", type=int, default=1_100_000, help="tokens a document holds at least")
    p.add_argument("--tokenizer-bytes", type=int, default=32_000_000,
                   help="bytes of the training packages' files the tokenizer is trained on (default 32 MB)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tokenizer's file sample")
    args = p.parse_args(argv)
    if args.vocab < 257 or args.doc_tokens < 1 or (args.max_bytes is not None and args.max_bytes < 1):
        print("error: --vocab must be >= 257 (bytes and <|endoftext|>), --doc-tokens and --max-bytes positive",
              file=sys.stderr)
        return 2
    command = "python -m benchmarks.studies.code_corpus " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        d = build(args.out, args.packages, args.held_out, args.vocab, args.max_bytes, args.doc_tokens,
                  args.tokenizer_bytes, args.seed, command)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, s in d["splits"].items():
        print(f"{split}: {', '.join(s['packages'])}: {s['files']} files, {s['bytes'] / 1e6:.1f} MB, "
              f"{s['tokens'] / 1e6:.2f}M tokens, {s['documents']} documents "
              f"({s['documents_of_at_least_doc_tokens']} of >= {d['doc_tokens']} tokens)")
    if d["missing_packages"]:
        print(f"not installed, skipped: {', '.join(d['missing_packages'])}")
    print(f"tokenizer: {d['tokenizer']['vocab_size']} ids; {args.out}/corpus.json ({d['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
