"""Finding and reading documents in local files, and loading tokenizers (oomb/train/data/corpus.py, rows.py)."""

import json

import pytest

from oomb.train.data.corpus import DataError, byte_level_tokenizer, check_tokenizer_fits, find_sources, load_tokenizer
from oomb.train.data.rows import check_sources, iter_documents


def _write_corpus(root):
    """One source of every kind; returns the documents in the order oomb must read them."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "a.txt").write_text("first text file\nwith two lines")
    (root / "b.md").write_text("# markdown\n\nbody")
    (root / "c.jsonl").write_text(json.dumps({"text": "json one", "id": 1}) + "\n\n"
                                  + json.dumps({"text": "json two ü"}) + "\n")
    pq.write_table(pa.table({"text": ["parquet one", "parquet two"], "n": [1, 2]}), root / "d.parquet")
    datasets.Dataset.from_dict({"text": ["saved one", "saved two", "saved three"]}).save_to_disk(str(root / "e_saved"))
    (root / "ignored.csv").write_text("x,y\n")  # unknown types inside a folder are not data
    return ["first text file\nwith two lines", "# markdown\n\nbody", "json one", "json two ü",
            "parquet one", "parquet two", "saved one", "saved two", "saved three"]


def test_every_format_from_a_folder_a_glob_and_files(tmp_path):
    expected = _write_corpus(tmp_path)
    assert list(iter_documents(tmp_path)) == expected
    assert [s.kind for s in find_sources(tmp_path)] == ["text", "text", "jsonl", "parquet", "dataset"]
    assert list(iter_documents(str(tmp_path / "*.jsonl"))) == ["json one", "json two ü"]
    assert list(iter_documents([tmp_path / "d.parquet", tmp_path / "e_saved"])) == expected[4:]


def test_other_text_field(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"body": "hello"}) + "\n")
    assert list(iter_documents(tmp_path / "x.jsonl", text_field="body")) == ["hello"]


@pytest.mark.parametrize("name,content,match", [
    ("x.jsonl", '{"body": "no text"}\n', r"x.jsonl:1 has no field 'text'.*data.text_field"),
    ("x.jsonl", "{broken\n", r"x.jsonl:1 is not valid JSON"),
    ("x.jsonl", '{"text": 3}\n', "holds int, not a string"),
])
def test_bad_files_are_named(tmp_path, name, content, match):
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=match):
        list(iter_documents(tmp_path / name))


def test_named_files_of_any_suffix_are_text_and_folders_take_listed_suffixes(tmp_path):
    (tmp_path / "main.py").write_text("def f():\n    return 1\n")
    (tmp_path / "lib.rs").write_text("fn main() {}\n")
    (tmp_path / "a.txt").write_text("notes")
    (tmp_path / "x.csv").write_text("a,b\n")
    assert list(iter_documents([tmp_path / "main.py", tmp_path / "x.csv"])) == ["def f():\n    return 1\n", "a,b\n"]
    assert [s.path.name for s in find_sources(tmp_path)] == ["a.txt"]  # a folder: the known suffixes
    assert [s.path.name for s in find_sources(tmp_path, (".txt", ".py", ".rs"))] == ["a.txt", "lib.rs", "main.py"]
    assert [s.path.name for s in find_sources(str(tmp_path / "*.py"), (".py",))] == ["main.py"]
    with pytest.raises(DataError, match=r"pattern .*\*.py' matches no .* file \(data.suffixes lists more"):
        find_sources(str(tmp_path / "*.py"))
    (tmp_path / "latin1.py").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.py is not UTF-8 text: byte 3 is b'\\xe9'"):
        check_sources(find_sources(tmp_path / "latin1.py"))


def test_missing_paths_and_empty_folders(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        list(iter_documents(tmp_path / "nope"))
    with pytest.raises(DataError, match="matches no file"):
        list(iter_documents(str(tmp_path / "*.txt")))
    with pytest.raises(DataError, match="holds no"):
        list(iter_documents(tmp_path))
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(DataError, match="does not exist"):  # checked before the first document
        next(iter_documents([tmp_path / "a.txt", tmp_path / "missing.txt"]))


def test_parquet_and_dataset_missing_column(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"no column 'text' \(columns: \['body'\]\)"):
        list(iter_documents(tmp_path / "d.parquet"))
    datasets.Dataset.from_dict({"body": ["x"]}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"no column 'text'"):
        list(iter_documents(tmp_path / "saved"))


def test_byte_level_tokenizer_round_trips_and_saves(tmp_path):
    tok = byte_level_tokenizer()
    text = "héllo\n  wörld\t🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # id = byte value
    assert tok.decode(ids) == text
    assert len(tok) == 257 and tok.eos_token_id == 256
    tok.save_pretrained(tmp_path)
    again = load_tokenizer(tmp_path)  # a saved one loads through AutoTokenizer
    assert again.encode(text) == ids and again.eos_token_id == 256


def test_load_tokenizer_falls_back_only_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path).eos_token_id == 256  # no tokenizer files: byte level
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(DataError, match="cannot load the tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


def test_tokenizer_larger_than_the_model_is_refused():
    tok = byte_level_tokenizer()
    check_tokenizer_fits(tok, 257)
    with pytest.raises(DataError, match=r"257 ids but the model's embedding has only 64 rows.*byte-level"):
        check_tokenizer_fits(tok, 64)


def test_data_suffixes_are_normalised_and_checked():
    from oomb.train.config.settings import ConfigError, load_config
    from oomb.train.data.inputs import text_suffixes

    cfg = load_config(None, ["data.task=text", "data.suffixes=[py, .RS, .txt]"])
    assert text_suffixes(cfg) == (".txt", ".md", ".py", ".rs")
    for bad in ("[a/b]", "['']", "[.tar.gz]", "['*.py']"):
        with pytest.raises(ConfigError, match="is not a file suffix; write e.g. data.suffixes="):
            text_suffixes(load_config(None, [f"data.suffixes={bad}"]))


def test_a_text_run_reads_source_code_folders_with_data_suffixes(tmp_path):
    from oomb.train.config.presets import preset_config
    from oomb.train.config.settings import ConfigError, load_config
    from oomb.train.data.inputs import build_inputs

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("import os\n" * 40)
    (tmp_path / "pkg" / "b.py").write_text("print('hi')\n" * 40)
    config = preset_config("tiny")
    config.vocab_size = 300  # the byte-level tokenizer's 257 ids fit
    args = ["data.task=text", f"data.paths=[{tmp_path / 'pkg'}]", "data.seq_len=64"]
    with pytest.raises(ConfigError, match=r"holds no .txt, .md, .jsonl, .parquet file .*data.suffixes=\[.py\]"):
        build_inputs(load_config(None, args), config)
    inputs = build_inputs(load_config(None, [*args, "data.suffixes=[.py]"]), config)
    assert [s.path.name for s in inputs.corpus.sources] == ["a.py", "b.py"]
    (batch,) = inputs.batches(0)
    assert bytes(batch.input_ids[0, :10].tolist()) in (b"import os\n", b"print('hi'")
