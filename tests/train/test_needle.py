"""`oomb eval --task text`: a passkey in real text, the model's tokenizer, exact placement, greedy scoring."""

import json
import re

import pytest
import torch
from tiny_models import tiny_model

from oomb.cli import main
from oomb.train.data.corpus import byte_level_tokenizer
from oomb.train.eval.needle import (
    ANSWER_PREFIX,
    TextNeedleTask,
    builtin_sentences,
    chunked_scorer,
    split_sentences,
    text_needle_grid,
)

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _task(prompt="plain", seed=0, sentences=None, tokenizer=None, digits=5):
    return TextNeedleTask(tokenizer or byte_level_tokenizer(), sentences or builtin_sentences(400), digits=digits,
                          seed=seed, prompt=prompt)


def _haystack_of(task, sample):
    """The sample's haystack ids (the needle taken out) and where the needle sat in them."""
    ids = sample.input_ids.tolist()
    needle = task.needle_ids(sample.passkey)
    tail = len(task.question) + len(task.answer(sample.passkey)[0])
    at = sample.needle_start - len(task.head)
    hay = ids[len(task.head) : sample.needle_start] + ids[sample.needle_start + len(needle) : len(ids) - tail]
    return hay, at


@pytest.mark.parametrize("length", [None, 300, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_lengths_and_needle_places_are_exact(length, depth):
    task = _task()
    length = length or task.min_length(samples=4)
    sample = task.sample(length, depth, index=3)
    ids = sample.input_ids.tolist()
    assert len(ids) == length
    needle = task.needle_ids(sample.passkey)
    assert ids[: len(task.head)] == task.head
    assert ids[sample.needle_start : sample.needle_start + len(needle)] == needle
    text = task.tokenizer.decode(ids)
    assert text.count(f"The pass key is {sample.passkey}. Remember it.") == 1
    assert text.endswith(f"\n\nWhat is the pass key?\n{ANSWER_PREFIX} {sample.passkey}")
    assert task.tokenizer.decode(sample.input_ids[sample.answer_positions + 1]) == f" {sample.passkey}"
    assert sample.answer_positions.tolist() == list(range(length - 7, length - 1))  # " " and 5 digits
    # Byte-level ids: a token is a character. The needle goes at the sentence start nearest depth x haystack.
    hay, at = _haystack_of(task, sample)
    chars = task.tokenizer.decode(hay)
    starts = [i for i in range(len(chars)) if chars[i] == " " and (i == 0 or chars[i - 1] == ".")]
    assert at in starts
    assert abs(at - depth * len(hay)) == min(abs(s - depth * len(hay)) for s in starts)
    assert sample.needle_depth == pytest.approx(at / len(hay))


def test_a_haystack_shorter_than_the_length_is_cycled():
    sentences = ["One fish swims.", "Two birds sing!", "Is it raining?"]
    task = _task(sentences=sentences)
    sample = task.sample(2000, 0.5, index=0)
    assert sample.input_ids.numel() == 2000
    hay, _ = _haystack_of(task, sample)
    chars = task.tokenizer.decode(hay)
    assert chars.count(" One fish swims.") > 30 and "Two birds sing! Is it raining? One fish" in chars


def test_samples_are_deterministic_by_seed_and_index():
    a, b, other = _task(seed=1), _task(seed=1), _task(seed=2)
    assert torch.equal(a.sample(800, 0.4, 5).input_ids, b.sample(800, 0.4, 5).input_ids)
    assert not torch.equal(a.sample(800, 0.4, 5).input_ids, a.sample(800, 0.4, 6).input_ids)
    keys = {t.sample(800, 0.4, i).passkey for t in (a, other) for i in range(6)}
    assert len(keys) == 12 and all(len(k) == 5 and k[0] != "0" for k in keys)
    cells = [a.sample(800, d, 5) for d in (0.0, 1.0)]  # one sample index: the same key, haystack and length
    assert cells[0].passkey == cells[1].passkey
    assert _haystack_of(a, cells[0])[0] == _haystack_of(a, cells[1])[0]


def test_chat_template_frames_the_haystack_as_the_users_message():
    tok = byte_level_tokenizer()
    tok.chat_template = TEMPLATE
    task = _task("auto", tokenizer=tok)
    assert task.prompt == "chat"
    text = tok.decode(task.sample(700, 0.5, 0).input_ids)
    assert text.startswith("<|user|>\nThere is an important pass key hidden")
    assert re.search(r"\n\nWhat is the pass key\?<\|end\|>\n<\|assistant\|>\nThe pass key is \d{5}$", text)
    assert _task("auto").prompt == "plain"  # no template
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        _task("chat")
    tok.chat_template = "{% for m in messages %}{{ m['content'][:10] }}{% endfor %}"
    with pytest.raises(ValueError, match="does not copy the user's message"):
        _task("chat", tokenizer=tok)


def _bpe_tokenizer():
    """A byte-level BPE with merges learned on text with numbers: digits merge, with the space before them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    numbers = range(10000, 99999, 97)
    corpus = [f"The pass key is {n}. Remember it. {s}" for n, s in zip(numbers, builtin_sentences(), strict=False)]
    trainer = trainers.BpeTrainer(vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=2**62)


def test_answer_tokens_follow_the_tokenizers_merges():
    tok = _bpe_tokenizer()
    task = _task(tokenizer=tok)
    for index in range(8):
        sample = task.sample(600, 0.5, index)
        assert sample.input_ids.numel() == 600
        answer = tok.decode(sample.input_ids[sample.answer_positions + 1])
        assert answer.strip() == sample.passkey  # the merged " 4" (space and digit) counts as answer
        assert tok.decode(sample.input_ids).endswith(f"What is the pass key?\n{ANSWER_PREFIX} {sample.passkey}")
    assert len(task.answer("48213")[0]) < len(ANSWER_PREFIX) + 6  # merges happened
    # Keys tokenize to more or fewer tokens: min_length(n) is the shortest length samples 0..n-1 all fit in.
    shortest = task.min_length(samples=8)
    longest_key = max(range(8), key=lambda i: task.fixed_tokens(task.passkey(i)[0]))
    assert task.sample(shortest, 0.5, longest_key).input_ids.numel() == shortest
    with pytest.raises(ValueError, match=f"sample {longest_key} needs >= {shortest} tokens"):
        task.sample(shortest - 1, 0.5, longest_key)


def _oracle(task, shift=0):
    """A scorer told the answer: it reads the needle from the tokens before each answer token (never after)."""
    def score(ids, where):
        right = torch.zeros(where.shape, dtype=torch.bool)
        for b in range(ids.shape[0]):
            for j, p in enumerate(where[b].tolist()):
                seen = task.tokenizer.decode(ids[b, : p + 1])
                key = re.search(r"The pass key is (\d+)\. Remember it\.", seen).group(1)
                full = task.tokenizer(f"{ANSWER_PREFIX} {key}", add_special_tokens=False)["input_ids"]
                guess = full[len(full) - where.shape[1] + j] + shift
                right[b, j] = guess == int(ids[b, p + 1])
        return right, torch.where(right, 0.0, -20.0).double()
    return score


def _random_guess(vocab):
    gen = torch.Generator().manual_seed(0)

    def score(ids, where):
        guess = torch.randint(vocab, where.shape, generator=gen)
        right = guess == ids.gather(1, where + 1)
        return right, torch.where(right, 0.0, -torch.log(torch.tensor(float(vocab)))).double()
    return score


def test_a_scorer_told_the_answer_scores_all_and_a_guess_chance():
    task = _task(tokenizer=_bpe_tokenizer())
    grid = dict(lengths=[300, 700], depths=[0.0, 0.5, 1.0], samples=4, batch_size=3)
    told = text_needle_grid(task, _oracle(task), **grid)
    assert told["accuracy"] == [[1.0, 1.0]] * 3 and all(c["answer_logprob"] == 0 for c in told["cells"])
    assert all(c["needle_positions"][0] < c["needle_positions"][0] + 1 for c in told["cells"])
    off = text_needle_grid(task, _oracle(task, shift=1), **grid)
    assert off["accuracy"] == [[0.0, 0.0]] * 3
    guess = text_needle_grid(task, _random_guess(len(task.tokenizer)), **grid)
    assert guess["accuracy"] == [[0.0, 0.0]] * 3  # chance: 1 in 280^k
    assert all(c["token_accuracy"] < 0.2 for c in guess["cells"])


def test_chunked_scores_are_the_full_forwards_and_greedy_decoding():
    """A random tiny model: chunked_eval's argmax and log-probabilities equal a full forward's, and a sample
    counts as right exactly when greedy decoding after "The pass key is" emits its answer tokens."""
    model = tiny_model("llama", vocab_size=300, max_position_embeddings=2048)
    task = _task()
    score = chunked_scorer(model, chunk_size=128, page_size=64)
    sample = task.sample(333, 0.5, 0)  # three chunks, the last ragged
    ids, where = sample.input_ids[None], sample.answer_positions[None]
    right, logprob = score(ids, where)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.double(), -1)[0]
    targets = ids[0, where[0] + 1]
    assert torch.equal(right[0], logp[where[0]].argmax(-1) == targets)
    assert torch.allclose(logprob[0], logp[where[0], targets], atol=1e-4)
    # Put the model's own greedy continuation where the answer goes: now every answer token is right.
    prompt = ids[:, : where[0, 0] + 1]
    greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=where.shape[1],
                            do_sample=False, pad_token_id=0)[:, prompt.shape[1] :]
    forced = torch.cat([prompt, greedy], dim=1)
    right, _ = score(forced, where)
    assert right.all()
    forced[0, -2] = (forced[0, -2] + 1) % 300  # one answer token off: that one is wrong, so the sample is
    right, _ = score(forced, where)
    assert right[0, :-2].all() and not right[0, -2]  # the tokens before it unchanged, still right


def test_split_sentences():
    assert split_sentences("A b. C d!  E?\nF g\n\n  H.") == ["A b.", "C d!", "E?", "F g", "H."]
    assert all(not re.search(r"\d", s) for s in builtin_sentences())


@pytest.fixture
def model_with_tokenizer(tmp_path):
    path = tmp_path / "hf"
    tiny_model("llama", vocab_size=300, max_position_embeddings=1024).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


def test_cli_text_task_is_the_default_for_a_model_with_a_tokenizer(tmp_path, model_with_tokenizer):
    hay = tmp_path / "hay"
    hay.mkdir()
    (hay / "a.txt").write_text("Rivers run to the sea. " * 30 + "\n" + "Clouds drift by! " * 30)
    out = tmp_path / "eval"
    assert main(["eval", str(model_with_tokenizer), "--retrieval", "--haystack", str(hay), "--lengths", "256,400",
                 "--depths", "0,1", "--samples", "2", "--chunk-size", "128", "--page-size", "64",
                 "--out", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())["retrieval"]
    assert r["task"] == "text" and r["prompt"] == "plain" and r["haystack"] == [str(hay)]
    assert r["prompt_frame"]["answer"] == " " + r["prompt_frame"]["needle"].split()[4].rstrip(".")
    assert len(r["cells"]) == 4 and all(c["accuracy"] == 0.0 for c in r["cells"])  # random weights: chance
    assert (out / "retrieval.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "args,match",
    [
        (["tiny", "--retrieval", "--task", "text"], "257 ids but the model's embedding has only 64"),
        (["{hf}", "--retrieval", "--task", "passkey", "--haystack", "{hf}"], "--haystack is the text of --task text"),
        (["{hf}", "--retrieval", "--lengths", "128"], "too short for the needle prompt.*at least"),
        (["{hf}", "--retrieval", "--prompt", "chat", "--lengths", "512"], "needs a tokenizer with a chat template"),
        (["{hf}", "--retrieval", "--task", "needle", "--prompt", "plain"], "--prompt frames --task text"),
        (["{hf}", "--retrieval", "--haystack", "no/such/text"], "does not exist"),
    ],
)
def test_cli_refuses_bad_text_task_input(tmp_path, model_with_tokenizer, capsys, args, match):
    out = tmp_path / "eval"
    assert main(["eval", *[a.format(hf=model_with_tokenizer) for a in args], "--out", str(out)]) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert re.search(match, printed), printed
    assert not out.exists()
