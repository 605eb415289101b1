"""Chat / SFT data (data.task=chat): rows, assistant masks, whole-sample packing, counts, runs and resumes."""

import json
import random
import re

import pytest
import torch
from chat_tokenizer import (
    END_MARK_TEMPLATE,
    GENERATION_TEMPLATE,
    NO_HEADER_TEMPLATE,
    PLAIN_TEMPLATE,
    chat_tokenizer,
)
from tiny_models import tiny_model

from oomb.cli import main
from oomb.train.config.presets import preset_config
from oomb.train.config.settings import load_config
from oomb.train.data.chat import ChatTemplate, conversation, open_chat_rows, plain_pair
from oomb.train.data.chat_packing import ChatCorpus
from oomb.train.data.corpus import DataError, find_sources
from oomb.train.data.inputs import build_inputs
from oomb.train.loop.distributed import DistributedContext
from oomb.train.loop.gradients import accumulate_gradients
from oomb.train.runfolder.checkpoint import find_checkpoint

FAST = ["data.seq_len=128", "train.chunk_size=64", "train.page_size=32", "train.device=cpu", "train.lr=0.01",
        "train.warmup_steps=1"]
CONVERSATION = [
    {"role": "system", "content": "you are a helpful bot ."},
    {"role": "user", "content": "what is two plus three ?"},
    {"role": "assistant", "content": "five ."},
    {"role": "user", "content": "thanks"},
    {"role": "assistant", "content": "ok bye !"},
]
# (token, carries loss) of CONVERSATION: the assistant's words and the <|end|> that closes each of its turns.
SYSTEM_USER = [("<|system|>", 0), ("you", 0), ("are", 0), ("a", 0), ("helpful", 0), ("bot", 0), (".", 0),
               ("<|end|>", 0), ("<|user|>", 0), ("what", 0), ("is", 0), ("two", 0), ("plus", 0), ("three", 0),
               ("?", 0), ("<|end|>", 0)]
EXPECTED = [("<s>", 0), *SYSTEM_USER, ("<|assistant|>", 0), ("five", 1), (".", 1), ("<|end|>", 1),
            ("<|user|>", 0), ("thanks", 0), ("<|end|>", 0), ("<|assistant|>", 0), ("ok", 1), ("bye", 1), ("!", 1),
            ("<|end|>", 1)]


def _tokens(tokenizer, ids, mask):
    return list(zip(tokenizer.convert_ids_to_tokens(ids.tolist()), mask.astype(int).tolist(), strict=True))


@pytest.mark.parametrize("template,method", [(GENERATION_TEMPLATE, "generation"), (PLAIN_TEMPLATE, "prefixes")])
def test_assistant_masks_are_exact_by_generation_tags_and_by_prefixes(template, method):
    tokenizer = chat_tokenizer(template)
    chat = ChatTemplate(tokenizer)
    assert chat.method == method
    ids, mask = chat.encode(CONVERSATION, "row")
    assert _tokens(tokenizer, ids, mask) == EXPECTED
    ids, mask = chat.encode(CONVERSATION, "row", assistant=False)  # data.loss_on=all: no search
    assert _tokens(tokenizer, ids, mask) == [(t, 0) for t, _ in EXPECTED]


def test_prefixes_without_a_header_and_templates_that_render_prefixes_differently():
    tokenizer = chat_tokenizer(NO_HEADER_TEMPLATE)  # ignores add_generation_prompt: the header is the message's
    ids, mask = ChatTemplate(tokenizer).encode(CONVERSATION, "row")
    expected = [(t, int(m or t == "<|assistant|>")) for t, m in EXPECTED[1:]]
    assert _tokens(tokenizer, ids, mask) == expected
    chat = ChatTemplate(chat_tokenizer(END_MARK_TEMPLATE))
    with pytest.raises(DataError, match=r"data.jsonl:3: the chat template renders .* assistant message 2 .*"
                                        r"\{% generation %\}.*data.loss_on=all"):
        chat.encode(CONVERSATION, "data.jsonl:3")
    ids, _ = chat.encode(CONVERSATION, "data.jsonl:3", assistant=False)
    assert tokenizer.convert_ids_to_tokens(ids.tolist())[-1] == "</s>"


def test_a_tokenizer_without_a_chat_template_is_refused_at_the_first_conversation():
    chat = ChatTemplate(chat_tokenizer(None))
    with pytest.raises(DataError, match="the tokenizer has no chat template: set data.chat_template.*data.jsonl:4 is a "
                                        "conversation"):
        chat.encode(CONVERSATION, "data.jsonl:4")
    assert chat.encode_plain("hi", "hello")[0].size  # plain text needs no template
    assert ChatTemplate(chat_tokenizer(None), PLAIN_TEMPLATE).method == "prefixes"


@pytest.mark.parametrize("prompt,completion", [("what is two plus three ?", "five ."), ("hi", "hello</s>"),
                                               ("tell me", "")])
@pytest.mark.parametrize("loss_on", ["assistant", "all"])
def test_plain_text_pairs_are_tokenized_and_masked_as_trl_does(tmp_path, prompt, completion, loss_on):
    # TRL's SFTTrainer prepares the same rows itself (its own code, not a copy of it): ids and the loss mask agree.
    import datasets
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    tokenizer = chat_tokenizer(None)
    rows = [{"prompt": prompt, "completion": completion}]
    model = AutoModelForCausalLM.from_config(preset_config("tiny"))
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=datasets.Dataset.from_list(rows),
                         args=SFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True,
                                                       completion_only_loss=loss_on != "all"))
    (sample,) = trainer.train_dataset
    batch = trainer.data_collator([sample])
    ids, mask = ChatTemplate(tokenizer).encode_plain(prompt, completion, assistant=loss_on == "assistant")
    assert ids.tolist() == sample["input_ids"]
    trl_loss = batch["labels"][0] != -100
    assert (mask if loss_on == "assistant" else mask | True).tolist() == trl_loss.tolist()
    if completion:  # oomb's chat data packs the same tokens, the first one predicted by nothing of its own
        (tmp_path / "pairs.jsonl").write_text(json.dumps(rows[0]) + "\n")
        corpus = ChatCorpus(tmp_path / "pairs.jsonl", tokenizer, len(ids) + 4, loss_on=loss_on, shuffle=False)
        packed_ids, labels, _ = corpus.next_sequence()
        assert packed_ids[: len(ids)].tolist() == ids.tolist()
        assert (labels[: len(ids)] != -100).tolist() == [False, *trl_loss.tolist()[1:]]


def test_rows_of_every_form_and_file_kind(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    listed = {"prompt": [{"role": "system", "content": "sure"}, {"role": "user", "content": "hi"}],
              "completion": [{"role": "assistant", "content": "hello"}]}
    pair = {"prompt": "hi", "completion": "hello there"}
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in ({"messages": CONVERSATION}, pair, listed))
                                      + "\n\n")
    pq.write_table(pa.Table.from_pylist([{"messages": CONVERSATION[:3]}]), tmp_path / "b.parquet")
    datasets.Dataset.from_list([pair]).save_to_disk(str(tmp_path / "c_saved"))
    (tmp_path / "notes.txt").write_text("a folder's text files are not chat data")
    sources = find_sources(tmp_path, text_suffixes=())
    assert [s.kind for s in sources] == ["jsonl", "parquet", "dataset"]
    rows = [(r.where, plain_pair(r.value, r.where) or conversation(r.value, r.where))
            for source in sources for r in open_chat_rows(source)]
    assert rows == [
        (f"{tmp_path / 'a.jsonl'}:1", CONVERSATION),
        (f"{tmp_path / 'a.jsonl'}:2", ("hi", "hello there")),  # plain text, as TRL reads it
        (f"{tmp_path / 'a.jsonl'}:3", listed["prompt"] + listed["completion"]),
        (f"{tmp_path / 'b.parquet'} row 0", CONVERSATION[:3]),
        (f"{tmp_path / 'c_saved'} row 0", ("hi", "hello there")),
    ]
    with pytest.raises(DataError, match="not text files"):
        open_chat_rows(find_sources(tmp_path / "notes.txt")[0])


@pytest.mark.parametrize("line,match", [
    ('{"messages": [{"role": "robot", "content": "hi"}]}', r":2: messages\[0\] has the role 'robot'; roles are"),
    ('{"messages": [{"role": "user", "content": 3}]}', r":2: messages\[0\]: 'content' must be a string, got int"),
    ('{"messages": [{"content": "hi"}]}', r":2: messages\[0\] must be an object with 'role' and 'content'"),
    ('{"messages": []}', ":2: the conversation has no message"),
    ('{"messages": "hi"}', ":2: 'messages' must be a list of messages, got str"),
    ('{"prompt": "hi"}', ":2 has prompt without completion: give both"),
    ('{"prompt": "hi", "completion": "yes", "messages": []}', ":2 has both 'messages' and 'prompt'/'completion'"),
    ('{"text": "hi"}', r":2 has no 'messages' and no 'prompt'/'completion' \(it has \['text'\]\)"),
    ('["hi"]', ":2 holds a JSON list, not an object"),
    ('{"messages": [', ":2 is not valid JSON"),
])
def test_bad_rows_are_named_with_their_file_and_line(tmp_path, line, match):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "completion": "hello"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=re.escape(str(path)) + match):
        ChatCorpus(path, chat_tokenizer(), 64)


def _write_conversations(path, n, seed=0, words=(1, 12)):
    """``n`` rows of random length; returns their messages."""
    rng = random.Random(seed)
    vocab = "hi hello there two three four five six seven one yes no ok".split()
    rows = []
    for _ in range(n):
        turns = []
        for _ in range(rng.randint(1, 3)):
            turns.append({"role": "user", "content": " ".join(rng.choices(vocab, k=rng.randint(*words)))})
            turns.append({"role": "assistant", "content": " ".join(rng.choices(vocab, k=rng.randint(*words)))})
        rows.append(turns)
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return rows


def test_samples_are_packed_whole_each_its_own_document(tmp_path):
    tokenizer = chat_tokenizer()
    rows = _write_conversations(tmp_path / "chat.jsonl", 40)
    chat = ChatTemplate(tokenizer)
    expected = {}
    for messages in rows:
        ids, mask = chat.encode(messages, "row")
        labels = torch.where(torch.from_numpy(mask), torch.from_numpy(ids), -100)
        labels[0] = -100
        expected[tuple(ids.tolist())] = labels
    seq_len = 96
    assert max(map(len, expected)) <= seq_len < sum(map(len, expected))
    corpus = ChatCorpus(tmp_path / "chat.jsonl", tokenizer, seq_len, seed=3)
    assert (corpus.counts.rows, corpus.counts.kept) == (40, 40)
    seen, sequences = [], []
    while corpus.state_dict()["epoch"] == 0:
        batch = corpus.batch(1)
        ids, labels, docs = batch.input_ids[0], batch.labels[0], batch.doc_ids[0]
        assert ids.shape == labels.shape == docs.shape == (seq_len,)
        assert int(docs[0]) == 0 and bool((docs[1:] - docs[:-1] >= 0).all()) and bool((docs[1:] - docs[:-1] <= 1).all())
        pieces = [(ids[docs == d], labels[docs == d]) for d in range(int(docs[-1]) + 1)]
        used = sum(len(p) for p, _ in pieces if tuple(p.tolist()) in expected)
        for piece_ids, piece_labels in pieces:
            if tuple(piece_ids.tolist()) in expected:  # a whole sample, its labels its own
                assert torch.equal(piece_labels, expected[tuple(piece_ids.tolist())])
                seen.append(tuple(piece_ids.tolist()))
            else:  # the padding after the last sample that fits: its own document, no loss
                assert piece_ids is pieces[-1][0] and len(piece_ids) == seq_len - used
                assert bool((piece_ids == tokenizer.pad_token_id).all()) and bool((piece_labels == -100).all())
        sequences.append((seq_len - used, pieces[0][0]))
    assert sorted(seen[: len(expected)]) == sorted(expected)  # the first epoch: every sample once, none cut
    for (pad, _), (_, first) in zip(sequences, sequences[1:], strict=False):
        assert pad < len(first)  # the next sample did not fit in what was left
    assert len(set(seen[: len(seen) // 2])) > 1 and seen != [tuple(r) for r in expected]  # shuffled


def test_overlong_samples_are_dropped_or_truncated_and_counted(tmp_path):
    tokenizer = chat_tokenizer()
    long_answer = {"role": "assistant", "content": " ".join(["seven"] * 40)}
    long_question = {"role": "user", "content": " ".join(["six"] * 40)}
    rows = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],  # 8 tokens
            [{"role": "user", "content": "hi"}, long_answer],  # long, assistant tokens from the start
            [long_question, {"role": "assistant", "content": "ok"}],  # long, the answer beyond 32 tokens
            [{"role": "user", "content": "hi"}],  # no assistant message: nothing to learn
            [{"role": "user", "content": "count to seven"}, {"role": "assistant", "content": "one two"}]]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    dropped = ChatCorpus(path, tokenizer, 32, overlong="drop")
    c = dropped.counts
    assert (c.kept, c.too_long, c.no_loss, c.truncated) == (2, 2, 1, 0)
    assert dropped.counts.summary(32) == ("chat data: 2 of 5 samples kept; 3 dropped: 2 longer than data.seq_len=32 "
                                          "(data.overlong=drop), 1 without a token that carries loss")
    cut = ChatCorpus(path, tokenizer, 32, overlong="truncate")
    c = cut.counts
    assert (c.kept, c.too_long, c.no_loss, c.truncated) == (3, 0, 2, 1)
    assert "1 cut to data.seq_len=32 tokens (data.overlong=truncate)" in cut.counts.summary(32)
    first_tokens, _ = ChatTemplate(tokenizer).encode(rows[1], "row")
    samples = []
    for _ in range(3):
        batch = cut.batch(1)
        docs = batch.doc_ids[0]
        samples += [batch.input_ids[0][docs == d].tolist() for d in range(int(docs[-1]) + 1)]
    assert first_tokens[:32].tolist() in samples  # the kept part of the long answer: its first 32 tokens
    everything = ChatCorpus(path, tokenizer, 32, overlong="drop", loss_on="all")  # the no-assistant row has loss
    assert (everything.counts.kept, everything.counts.no_loss) == (3, 0)
    with pytest.raises(DataError, match="no sample can train: chat data: 0 of 5 samples kept"):
        ChatCorpus(path, tokenizer, 6)


def test_the_position_round_trips(tmp_path):
    _write_conversations(tmp_path / "a.jsonl", 15, seed=1)
    _write_conversations(tmp_path / "b.jsonl", 9, seed=2)
    straight = ChatCorpus(tmp_path, chat_tokenizer(), 80, seed=5)
    for _ in range(7):
        straight.batch(2)
    state = json.loads(json.dumps(straight.state_dict()))  # as state.json holds it
    resumed = ChatCorpus(tmp_path, chat_tokenizer(), 80, seed=5)
    resumed.load_state_dict(state)
    for _ in range(6):  # across the end of the epoch
        a, b = straight.batch(2), resumed.batch(2)
        for field in ("input_ids", "labels", "doc_ids"):
            assert torch.equal(getattr(a, field), getattr(b, field))
    assert straight.state_dict()["epoch"] >= 1
    with pytest.raises(DataError, match=r"lacks \['window', 'start', 'index'\].*older oomb"):
        resumed.load_state_dict({"epoch": 0, "source": 0, "sample": 3})  # what oomb wrote before windows


def test_a_packed_chat_batch_trains_each_sample_as_if_alone(tmp_path):
    """No attention across samples, positions as from 0 (RoPE is relative): each sample's loss as if run alone."""
    _write_conversations(tmp_path / "chat.jsonl", 12, seed=4)
    cfg = load_config(None, ["data.task=chat", f"data.paths=[{tmp_path}]", *FAST])
    corpus = ChatCorpus(tmp_path, chat_tokenizer(), 128, seed=0)
    batch = corpus.batch(1)
    assert int(batch.doc_ids.max()) >= 2  # several samples in the sequence
    model = tiny_model("llama")
    loss = accumulate_gradients(model, [batch], DistributedContext.single(torch.device("cpu")), cfg)
    ids, labels, docs = batch.input_ids[0], batch.labels[0], batch.doc_ids[0]
    total, count = 0.0, 0
    with torch.no_grad():
        for d in range(int(docs.max()) + 1):
            sample, targets = ids[docs == d], labels[docs == d]
            logits = model(sample[None]).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, targets[1:], reduction="sum",
                                                             ignore_index=-100))
            count += int((targets[1:] != -100).sum())
    assert float(loss) == pytest.approx(total / count, rel=1e-5)


def _chat_folder(tmp_path):
    """A tokenizer folder without a chat template, the template in a .jinja file, and conversations."""
    chat_tokenizer(None).save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "chat.jinja").write_text(PLAIN_TEMPLATE)
    data = tmp_path / "data"
    data.mkdir()
    rng = random.Random(0)
    rows = []
    for _ in range(60):  # a learnable task: repeat the user's words
        words = " ".join(rng.choices("one two three four five six seven".split(), k=rng.randint(2, 6)))
        rows.append({"prompt": [{"role": "user", "content": f"tell me {words}"}],
                     "completion": [{"role": "assistant", "content": f"{words} ."}]})
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"data.tokenizer={tmp_path / 'tokenizer'}", f"data.chat_template={tmp_path / 'chat.jinja'}",
            "data.task=chat", f"data.paths=[{data}]"]


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_chat_run_learns_counts_its_loss_tokens_and_resumes_exactly(tmp_path, capsys):
    import shutil

    from transformers import AutoTokenizer

    fast = [a for a in FAST if not a.startswith("train.lr=")]
    args = [*_chat_folder(tmp_path), *fast, "train.grad_accum=2", "train.steps=12", "train.save_every=6",
            "train.lr=0.02"]
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", *args]) == 0
    assert "chat data: 60 of 60 samples kept" in capsys.readouterr().out
    records = _metrics(run)
    assert records[-1]["loss"] < 0.7 * records[0]["loss"]
    inputs = build_inputs(load_config(None, args), preset_config("tiny"))  # the run's batches, drawn again
    for r in records:
        batches = inputs.batches(r["step"] - 1)
        assert r["loss_tokens"] == sum(int((b.labels[:, 1:] != -100).sum()) for b in batches)
        assert 0 < r["loss_tokens"] < 2 * 127
    state = json.loads((find_checkpoint(run) / "state.json").read_text())
    assert set(state["data"]["chat"]) == {"epoch", "source", "window", "start", "index"}
    exported = AutoTokenizer.from_pretrained(run / "export")
    assert exported.chat_template == PLAIN_TEMPLATE  # data.chat_template goes with the model

    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "export")
    assert main(["train", f"resume={copy / 'checkpoints' / 'step-00000006'}"]) == 0
    assert [r["loss"] for r in _metrics(copy)] == [r["loss"] for r in records]
    final = "checkpoints/step-00000012/model.safetensors"
    assert (copy / final).read_bytes() == (run / final).read_bytes()


def test_every_task_logs_its_loss_tokens(tmp_path):
    run = tmp_path / "run"
    assert main(["train", f"out_dir={run}", "train.steps=2", "train.grad_accum=2", "train.export=false",
                 "data.loss_on=answer", "data.passkey_digits=3", *FAST]) == 0
    assert [r["loss_tokens"] for r in _metrics(run)] == [2 * 3, 2 * 3]  # the answer digits of two sequences


@pytest.mark.parametrize("args,match", [
    (["data.task=chat"], "data.task=chat needs data.paths"),
    (["data.task=chat", "data.paths=[{data}]", "data.loss_on=answer"],
     "data.loss_on='answer' with data.task=chat: choose auto or assistant or all"),
    (["data.task=chat", "data.paths=[{data}]", "data.overlong=cut"], "data.overlong='cut': choose drop"),
    (["data.task=chat", "data.paths=[{data}]", "data.suffixes=[.py]"], r"data.suffixes=\['.py'\] needs data.task=text"),
    (["data.chat_template=x.jinja"], "data.chat_template=x.jinja needs data.task=chat"),
    (["data.overlong=truncate"], "data.overlong=truncate needs data.task=chat"),
    (["data.task=text", "data.paths=[{data}]", "data.loss_on=assistant"],
     "data.loss_on='assistant' with data.task=text"),
    (["data.task=chat", "data.paths=[{data}]", "data.chat_template=missing.jinja"],
     "data.chat_template='missing.jinja' holds no Jinja tags and is not a file"),
])
def test_bad_chat_settings_stop_before_work(tmp_path, capsys, args, match):
    common = _chat_folder(tmp_path)
    data = common[-1].split("[")[1].rstrip("]")
    out = tmp_path / "out"
    args = [a.replace("{data}", data) for a in args]
    tokenizer = [a for a in common if a.startswith("data.tokenizer")]
    assert main(["train", f"out_dir={out}", *FAST, *tokenizer, *args]) == 2
    assert re.search(match, capsys.readouterr().out.replace("\n", "")), match
    assert not out.exists()


def test_a_tokenizer_without_template_and_no_data_chat_template_is_refused(tmp_path, capsys):
    common = [a for a in _chat_folder(tmp_path) if not a.startswith("data.chat_template")]
    assert main(["train", f"out_dir={tmp_path / 'out'}", *FAST, *common]) == 2
    assert "the tokenizer has no chat template: set data.chat_template" in capsys.readouterr().out.replace("\n", "")
