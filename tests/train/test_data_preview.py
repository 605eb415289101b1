"""`oomb data`: the first packed sequence with the tokens that carry loss marked, read as `oomb train` reads it."""

import json

from chat_tokenizer import PLAIN_TEMPLATE, chat_tokenizer

from oomb.cli import main

CONVERSATION = {"messages": [{"role": "user", "content": "what is two plus three ?"},
                             {"role": "assistant", "content": "five ."}]}
PAIR = {"prompt": "tell me one two", "completion": " one two ."}


def _chat(tmp_path):
    chat_tokenizer(PLAIN_TEMPLATE).save_pretrained(tmp_path / "tok")
    (tmp_path / "d.jsonl").write_text(f"{json.dumps(CONVERSATION)}\n{json.dumps(PAIR)}\n")
    return ["model.preset=tiny", "data.task=chat", f"data.paths=[{tmp_path / 'd.jsonl'}]",
            f"data.tokenizer={tmp_path / 'tok'}", "data.seq_len=64", "train.device=cpu", f"out_dir={tmp_path / 'run'}"]


def test_the_first_sequence_shows_its_documents_and_loss_tokens(tmp_path, capsys):
    assert main(["data", *_chat(tmp_path), "train.seed=0"]) == 0
    out = capsys.readouterr().out
    # Samples packed whole: the conversation's reply and its end mark carry loss, the
    # plain-text pair's completion and the EOS TRL appends to it; prompts, headers and padding do not.
    assert "first sequence of step 1: 64 tokens, 21 carry loss (32.8%), 7 documents" in out
    assert "<s> <|user|> what is two plus three ? <|end|> <|assistant|>«five . <|end|>»" in out
    assert "tell me one two«one two . </s>»" in out
    assert "--- document 6\n<pad>" in out
    assert not (tmp_path / "run").exists()  # nothing written


def test_one_line_per_token(tmp_path, capsys):
    assert main(["data", *_chat(tmp_path), "--tokens", "--max-tokens", "12"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index("position  id  token  loss  document") + 1:]
    assert table[0] == "0 2 '<s>' 0 0" and table[9] == "9 6 '<|assistant|>' 0 0"
    assert table[10] == "10 17 'five' 1 0" and len(table) == 12


def test_loss_on_all_and_the_config_errors_of_oomb_train(tmp_path, capsys):
    assert main(["data", *_chat(tmp_path), "data.loss_on=all"]) == 0
    assert "64 tokens, 57 carry loss" in capsys.readouterr().out  # every token but each sample's first and padding
    assert main(["data", *_chat(tmp_path), "data.seq_len=4"]) == 2
    assert "config error:" in capsys.readouterr().out
