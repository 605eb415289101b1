"""<run>/inputs.json: what a run trains on, recorded when it starts and compared when it resumes.

    {"format": 1, "fingerprint": "<how a fingerprint is made: oomb.train.data.identity.FINGERPRINT>",
     "data": {"data.paths": [{"path": "/abs/rows.jsonl", "bytes": 1900, "fingerprint": "<sha256 hex>"},
                             {"stream": "owner/name@<commit>:train"}, ...],
              "data.val_paths": [...]},
     "model": {"path": "/abs/model", "files": [{"name": "model.safetensors", "bytes": ..., "fingerprint": ...}]}
              or {"hub": "owner/name@<commit>"} or {"preset": "tiny"}}

The data files are those the readers open, in the order they read them: each file of data.paths and
data.val_paths as oomb.train.data.corpus.find_sources finds it (folders and glob patterns expanded), the arrow
files of a saved ``datasets`` folder, every file of a local dataset repository read with its split. A hub
dataset is its pinned reference (config.json records the commit): nothing to hash. The base model is its
folder's weight files (WEIGHTS), or its hub reference at its commit, or the preset.

A resume compares the record with the files as they are (``check_inputs``) before any work: a file missing,
new (in a folder, a pattern, a data.paths entry added), of another size or content, or another base, is
refused with a ConfigError naming each file and how it changed, and the key that accepts the change
(data.accept_changed, model.accept_changed); with it, the resume goes on and the record follows the files.
The same files at other paths, byte for byte (a data folder moved), need no key. Those keys are one resume's
word: config.json records them false, and a run folder's config.json never sets them (rundir.load_run_config).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from oomb.train.config.bounded import loads_json
from oomb.train.config.settings import Config, ConfigError
from oomb.train.data.corpus import DataError, find_sources
from oomb.train.data.identity import FINGERPRINT, FileId, describe_change, identify
from oomb.train.data.inputs import text_suffixes
from oomb.train.loop.faults import resume_command
from oomb.train.runfolder.runfiles import check, read_text, write_text_atomic

INPUTS = "inputs.json"
FORMAT = 1
# A model folder's files that hold its weights (top level, as from_pretrained reads them).
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
SHOWN = 12  # changed files listed in a message; the rest are counted


@dataclass
class InputsCheck:
    """What a starting run found: ``record`` (inputs.json's content as the files are now), ``files`` (its data
    files, for oomb.train.data.identity.watch), whether inputs.json is to be written once the run folder is
    locked (``write``), and notes for the startup lines."""

    record: dict
    files: list[FileId] = field(default_factory=list)
    write: bool = True
    notes: list[str] = field(default_factory=list)


def describe_inputs(cfg: Config) -> tuple[dict, list[FileId]]:
    """The record of ``cfg``'s inputs as they are now, and its data files (the module's docstring)."""
    data, files = {}, []
    d = cfg.data
    if d.task in ("text", "chat"):
        suffixes = text_suffixes(cfg) if d.task == "text" else ()
        for key, paths in (("data.paths", d.paths), ("data.val_paths", d.val_paths)):
            if paths:
                data[key] = _data_entries(paths, suffixes, files)
    record = {"format": FORMAT, "fingerprint": FINGERPRINT, "data": data, "model": _model_entry(cfg)}
    return record, files


def _data_entries(paths: list[str], suffixes: tuple[str, ...], files: list[FileId]) -> list[dict]:
    entries = []
    for text in paths:
        try:
            sources = find_sources([text], suffixes)
        except DataError:
            continue  # a path that does not exist: the data check names it, a resume's comparison as missing
        for source in sources:
            if source.kind == "stream" and not Path(source.ref.name).is_dir():
                entries.append({"stream": str(source.ref)})
                continue
            if source.kind == "stream":  # a local dataset repository: every file of it
                found = [Path(root, name) for root, dirs, names in os.walk(source.ref.name)
                         for name in names if not _hidden(Path(root, name), Path(source.ref.name))]
            elif source.kind == "dataset":
                found = list(Path(source.path).rglob("*.arrow"))
            else:
                found = [source.path]
            for path in sorted(found):
                file = _identify(path)
                if file is not None:
                    files.append(file)
                    entries.append({"path": file.path, "bytes": file.size, "fingerprint": file.fingerprint,
                                    "in": text})
    return entries


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _identify(path: Path) -> FileId | None:
    """The file's identity; None where it cannot be read (the data check names it)."""
    try:
        return identify(path)
    except OSError:
        return None
    except DataError as e:
        raise ConfigError(str(e)) from None


def _model_entry(cfg: Config) -> dict:
    name = cfg.model.path
    if name is None:
        return {"preset": cfg.model.preset}
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return {"hub": name}
    weights = []
    for path in sorted(folder.iterdir()):
        if path.name.endswith(WEIGHTS) and path.is_file() and (file := _identify(path)) is not None:
            weights.append({"name": path.name, "bytes": file.size, "fingerprint": file.fingerprint})
    return {"path": name, "files": weights}


# --- the record in the run folder ----------------------------------------------------------------------------


def write_inputs(out: Path, record: dict) -> None:
    write_text_atomic(out / INPUTS, json.dumps(record, indent=1))


def read_inputs(run: Path) -> dict | None:
    """The run's record; None for a run without one (written before oomb recorded its inputs). A record that
    cannot be read or has another shape is refused, saying how to go on without it."""
    path = run / INPUTS
    try:
        if not check(path):
            return None
        record = loads_json(read_text(path))
        why = None if _well_formed(record) else "not the record of a run's inputs (another shape or format)"
    except (OSError, ValueError) as e:  # ValueError: not JSON, nested too deep (oomb.train.config.bounded)
        why = f"{type(e).__name__}: {e}"
    if why is None:
        return record
    raise ConfigError(f"cannot resume: {path} cannot be read: {why}. Remove it to resume without comparing the "
                      "data and the base model with what the run started from (a new record is written)")


def _well_formed(record) -> bool:
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("data"), dict):
        return False
    entries = [e for value in record["data"].values() for e in (value if isinstance(value, list) else [None])]
    model = record.get("model")
    return (all(isinstance(e, dict) and (_is_file(e) or isinstance(e.get("stream"), str)) for e in entries)
            and isinstance(model, dict) and all(_is_file(f, "name") for f in model.get("files", [])))


def _is_file(entry, name: str = "path") -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get(name), str) and type(entry.get("bytes")) is int
            and isinstance(entry.get("fingerprint"), str))


# --- the comparison on resume --------------------------------------------------------------------------------


def check_inputs(cfg: Config, run: Path | None, trained: bool) -> InputsCheck:
    """The inputs of a starting run (``run``: the resumed run's folder, None for a new run), compared with the
    record of a resumed run that ``trained`` (has a checkpoint); raises ConfigError for a change not accepted."""
    keys = [k for k, on in (("data.accept_changed", cfg.data.accept_changed),
                            ("model.accept_changed", cfg.model.accept_changed)) if on]
    if run is None and keys:
        raise ConfigError(f"{keys[0]}=true applies to resume=RUN: it lets a resumed run go on with inputs that "
                          "changed since the run recorded them. A new run records its data and base model as they "
                          "are: leave it out")
    record, files = describe_inputs(cfg)
    if run is None:
        return InputsCheck(record, files)
    old = read_inputs(run)
    if old is None:
        return InputsCheck(record, files, notes=[
            f"note: {run} holds no record of its data and base model ({INPUTS}, written by runs since oomb "
            "records them): they are recorded now, and a later resume compares them"])
    if not trained:  # nothing was trained on the recorded inputs: the run starts again from step 1 on these
        return InputsCheck(record, files, write=old != record)
    data, data_notes = _data_changes(old["data"], record["data"])
    model, model_notes = _model_changes(old["model"], record["model"])
    refused = [(key, lines) for key, lines, accepted in (("data.accept_changed", data, cfg.data.accept_changed),
                                                         ("model.accept_changed", model, cfg.model.accept_changed))
               if lines and not accepted]
    if refused:
        raise ConfigError(_refusal(cfg, run, data + model, [key for key, _ in refused]))
    notes = [f"note: {note}" for note in data_notes + model_notes]
    for key, lines in (("data.accept_changed", data), ("model.accept_changed", model)):
        if lines:
            notes.append(f"note: {key}=true: the run goes on with {'its data' if key[0] == 'd' else 'the base model'}"
                         f" as it is now ({_count(lines)}); {run / INPUTS} now records it")
    cfg.data.accept_changed = cfg.model.accept_changed = False  # this resume's word only: config.json says false
    return InputsCheck(record, files, write=old != record, notes=notes)


def _refusal(cfg: Config, run: Path, lines: list[str], keys: list[str]) -> str:
    shown = lines[:SHOWN] + ([f"... and {len(lines) - SHOWN} more"] if len(lines) > SHOWN else [])
    what = " and ".join(("the position in the data it holds counts the rows and bytes of the data files as they "
                         "were" if key[0] == "d" else "its weights were trained from that base model")
                        for key in keys)
    return (f"cannot resume {run}: what it trains on changed since the run recorded it in {run / INPUTS}:\n  "
            + "\n  ".join(shown) + f"\nThe checkpoint was written for those files: {what}. Put the files back as "
            f"they were and run the same command again, or add {' '.join(f'{key}=true' for key in keys)} to it to go "
            f"on with them as they are now (the record then follows them), e.g.:\n  "
            f"{resume_command(cfg.resume, *(f'{key}=true' for key in keys))}")


def _count(lines: list[str]) -> str:
    return f"{len(lines)} change{'s' if len(lines) > 1 else ''}"


def _name(entry: dict) -> str:
    return entry.get("path") or entry["stream"]


def _content(entries: list[dict]) -> list[tuple]:
    return [(e.get("stream"), e.get("bytes"), e.get("fingerprint")) for e in entries]


def _data_changes(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(how each data file differs, notes) between two records' data."""
    lines, notes = [], []
    for key in sorted(set(old) | set(new)):
        was, now = old.get(key, []), new.get(key, [])
        if _content(was) == _content(now):
            if [_name(e) for e in was] != [_name(e) for e in now]:
                notes.append(f"{key}: the same {len(now)} files, byte for byte, at other paths (moved): the record "
                             "follows them")
            continue
        before, after, first = {_name(e): e for e in was}, {_name(e): e for e in now}, len(lines)
        for name, entry in before.items():
            if name not in after:
                gone = "stream" not in entry and not os.path.lexists(name)
                lines.append(f"{key}: {name}: {'missing' if gone else f'no longer among {key}'}")
            elif _content([after[name]]) != _content([entry]):
                changed = describe_change(after[name]["bytes"], entry["bytes"])
                lines.append(f"{key}: {name}: {changed}")
        for name, entry in after.items():
            if name not in before:
                what = f"new among {key}" if "stream" in entry else f"a new file, found through {entry['in']!r}"
                lines.append(f"{key}: {name}: {what}")
        if len(lines) == first:  # the same files in another order
            lines.append(f"{key}: the same files in another order (the data position counts them in order)")
    return lines, notes


def _describe_model(entry: dict) -> str:
    if "preset" in entry:
        return f"model.preset={entry['preset']} (random init)"
    return f"model.path={entry.get('hub') or entry.get('path')}"


def _model_changes(old: dict, new: dict) -> tuple[list[str], list[str]]:
    """(how the base model differs, notes) between two records' model."""
    if old == new:
        return [], []
    if "files" not in old or "files" not in new:
        return [f"the base model is {_describe_model(new)}; the run started from {_describe_model(old)}"], []
    if old["files"] == new["files"]:
        return [], [f"model.path is {new['path']}, the run started from {old['path']}: their weight files are the "
                    "same, byte for byte"]
    before = {f["name"]: f for f in old["files"]}
    after = {f["name"]: f for f in new["files"]}
    folder = Path(new["path"])
    lines = []
    for name, entry in before.items():
        if name not in after:
            lines.append(f"model.path: {folder / name}: missing")
        elif after[name] != entry:
            lines.append(f"model.path: {folder / name}: {describe_change(after[name]['bytes'], entry['bytes'])}")
    lines += [f"model.path: {folder / name}: a new weight file" for name in after if name not in before]
    if old["path"] != new["path"]:
        lines.append(f"model.path is {new['path']}; the run started from {old['path']}")
    return lines, []
