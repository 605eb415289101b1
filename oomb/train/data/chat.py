"""Conversations for supervised fine-tuning (data.task=chat): rows read, rendered by a chat template, masked.

Rows — a line of a .jsonl, a row of a .parquet, of a ``save_to_disk`` folder or of a streamed
dataset (oomb.train.data.rows) — hold either ``messages`` or ``prompt`` and ``completion``::

    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    {"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}]}   TRL's conversational form
    {"prompt": "Q: 2+2?", "completion": " 4"}           plain text, as TRL reads it (below)

``ChatTemplate.encode`` renders a conversation with the chat template (the tokenizer's, or
data.chat_template), tokenizes it, and marks the tokens the assistant messages contribute::

    text   <user> Hi <end> <assistant> Hello ! <end>
    mask     0    0    0        0        1    1   1

Two ways to find those tokens, the first where the template allows it:

    generation  the template wraps assistant text in {% generation %} ... {% endgeneration %}:
                transformers' apply_chat_template(return_assistant_tokens_mask=True) marks it
    prefixes    otherwise: the text rendered for messages[:i] followed by the assistant header
                (add_generation_prompt) and the text rendered for messages[:i+1] bound the
                characters assistant message i adds; every token holding one of them is marked

A plain-text pair (``prompt`` and ``completion`` both strings) is read as TRL's SFTTrainer reads one: no chat
template, the text ``prompt + completion`` with the tokenizer's EOS appended to the completion (unless it ends
with it), tokenized with the tokenizer's own special tokens, and the completion's tokens marked: those after
the longest common start of the tokenized prompt and the tokenized whole (``ChatTemplate.encode_plain``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from oomb.train.config.bounded import quoted
from oomb.train.data.corpus import DataError, Source
from oomb.train.data.rows import open_rows

ROLES = ("system", "developer", "user", "assistant", "tool")
# transformers' own test for a template that marks assistant text (apply_chat_template).
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


CHAT_FIELDS = ("messages", "prompt", "completion")


def open_chat_rows(source: Source, position: dict | None = None):
    """oomb.train.data.rows.open_rows for conversations: rows of a .jsonl, .parquet, saved dataset or stream."""
    if source.kind == "text":
        raise DataError(f"{source.path}: data.task=chat reads conversations from .jsonl, .parquet, datasets' "
                        "save_to_disk folders or streamed datasets, not text files (data.task=text trains on text)")
    reader = open_rows(source, CHAT_FIELDS, position)
    if reader.columns is not None and not any(f in reader.columns for f in CHAT_FIELDS):
        raise DataError(f"{source.name} has no column 'messages' or 'prompt'/'completion' (columns: "
                        f"{reader.columns})")
    return reader


def plain_pair(row: dict, where: str) -> tuple[str, str] | None:
    """(prompt, completion) of a plain-text row (both strings, module docstring); None for a conversation."""
    _check_form(row, where)
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, str) != isinstance(completion, str) and prompt is not None and completion is not None:
        raise DataError(f"{where}: 'prompt' is {_kind(prompt)} and 'completion' {_kind(completion)}: give both as "
                        "strings (plain text) or both as lists of messages (a conversation)")
    return (prompt, completion) if isinstance(prompt, str) else None


def _kind(value) -> str:
    return "a string" if isinstance(value, str) else "a list of messages" if isinstance(value, list) else (
        f"a {type(value).__name__}")


def _check_form(row: dict, where: str) -> None:
    """One form per row: ``messages``, or ``prompt`` with ``completion``."""
    has_messages = row.get("messages") is not None
    has_pair = row.get("prompt") is not None or row.get("completion") is not None
    if has_messages and has_pair:
        raise DataError(f"{where} has both 'messages' and 'prompt'/'completion': keep one form per row")
    if has_pair and (row.get("prompt") is None or row.get("completion") is None):
        raise DataError(f"{where} has {'prompt' if row.get('prompt') is not None else 'completion'} without "
                        f"{'completion' if row.get('prompt') is not None else 'prompt'}: give both")


def conversation(row: dict, where: str) -> list[dict]:
    """The messages of a conversational row (a conversational prompt and completion joined), checked: roles,
    contents, at least one message. A plain-text pair is not a conversation (plain_pair)."""
    _check_form(row, where)
    if row.get("messages") is not None:
        messages = _messages(row["messages"], where, "messages")
    elif row.get("prompt") is not None:
        if plain_pair(row, where) is not None:
            raise DataError(f"{where}: a plain-text prompt and completion is not a conversation (plain_pair)")
        messages = (_messages(row["prompt"], where, "prompt") + _messages(row["completion"], where, "completion"))
    else:
        raise DataError(f"{where} has no 'messages' and no 'prompt'/'completion' (it has {quoted(list(row))})")
    if not messages:
        raise DataError(f"{where}: the conversation has no message")
    return messages


def empty_reply(messages: list[dict]) -> bool:
    """Whether an assistant message of the conversation says nothing: its content "" or whitespace, and no tool
    call. Such a sample would teach the model to end its turn at once; ChatCorpus counts it and drops it."""
    return any(m["role"] == "assistant" and not m.get("tool_calls") and isinstance(m.get("content"), str)
               and not m["content"].strip() for m in messages)


def _messages(value, where: str, field: str) -> list[dict]:
    """A message list, checked."""
    if not isinstance(value, list | tuple):
        kinds = "a string or a list of messages" if field != "messages" else "a list of messages"
        raise DataError(f"{where}: '{field}' must be {kinds}, got {type(value).__name__}")
    out = []
    for i, message in enumerate(value):
        at = f"{where}: {field}[{i}]"
        if not isinstance(message, dict) or "role" not in message:
            raise DataError(f"{at} must be an object with 'role' and 'content', got {quoted(message)}")
        if message["role"] not in ROLES:
            raise DataError(f"{at} has the role {quoted(message['role'])}; roles are {', '.join(ROLES)}")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise DataError(f"{at}: 'content' must be a string, got {type(content).__name__}")
        out.append(dict(message))
    return out


def read_template(value: str) -> str:
    """data.chat_template: the text itself when it holds Jinja tags ({{ or {%), else the path of a file holding it."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise DataError(f"data.chat_template={quoted(value)} holds no Jinja tags and is not a file: give the template "
                        "text or the path of a .jinja file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"data.chat_template: {path} cannot be read as UTF-8 text: {e}") from e


class ChatTemplate:
    """A tokenizer and the chat template it renders with; ``encode`` gives ids and the assistant mask."""

    def __init__(self, tokenizer, template: str | None = None) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise DataError("data.task=chat needs a fast tokenizer (a folder with tokenizer.json): the assistant "
                            "tokens are found through the character offsets of each token")
        self.tokenizer = tokenizer
        try:
            self.text = tokenizer.get_chat_template(template)
        except ValueError as e:  # plain-text pairs need none: refused at the first conversation
            self.text, self._missing = None, str(e)
        self.method = "generation" if self.text and _GENERATION_TAG.search(self.text) else "prefixes"

    def encode_plain(self, prompt: str, completion: str, assistant: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Token ids [n] of a plain-text pair as TRL's SFTTrainer makes them (module docstring) and which of them
        the completion added [n] bool (all False where ``assistant`` is False: data.loss_on=all)."""
        eos = self.tokenizer.eos_token
        if eos and not completion.endswith(eos):
            completion += eos
        prompt_ids = self.tokenizer(prompt, verbose=False)["input_ids"]
        ids = np.asarray(self.tokenizer(prompt + completion, verbose=False)["input_ids"], dtype=np.int64)
        same = np.asarray(prompt_ids[: len(ids)], dtype=np.int64) == ids[: len(prompt_ids)]
        start = int(same.argmin()) if not same.all() else len(same)  # the longest common start
        mask = np.zeros(len(ids), dtype=bool)
        mask[start:] = assistant
        return ids, mask

    def encode(self, messages: list[dict], where: str, assistant: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Token ids [n] int64 of the rendered conversation and which of them assistant messages added [n] bool.

        ``assistant=False``: the mask is all False and not searched for (data.loss_on=all).
        """
        import jinja2

        if self.text is None:
            raise DataError("the tokenizer has no chat template: set data.chat_template to a Jinja template or the "
                            f"path of a .jinja file ({where} is a conversation; plain-text prompt/completion rows need "
                            f"no template; {self._missing})")
        try:
            if not assistant:
                ids = self.tokenizer(self._render(messages), add_special_tokens=False, verbose=False)["input_ids"]
                return np.asarray(ids, dtype=np.int64), np.zeros(len(ids), dtype=bool)
            if self.method == "generation":
                out = self.tokenizer.apply_chat_template(
                    messages, chat_template=self.text, tokenize=True, return_dict=True,
                    return_assistant_tokens_mask=True, tokenizer_kwargs={"verbose": False})
                return np.asarray(out["input_ids"], dtype=np.int64), np.asarray(out["assistant_masks"], dtype=bool)
            return self._encode_by_prefixes(messages, where)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            if isinstance(e, DataError):
                raise
            raise DataError(f"{where}: the chat template cannot render this conversation: {type(e).__name__}: "
                            f"{e}") from e

    def _render(self, messages: list[dict], header: bool = False) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(messages, chat_template=self.text, tokenize=False,
                                                  add_generation_prompt=header)

    def _encode_by_prefixes(self, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
        full = self._render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            upto = self._render(messages[: i + 1])
            if not full.startswith(upto):
                raise DataError(f"{where}: the chat template renders the conversation up to assistant message {i} "
                                "differently than the whole conversation's start, so its tokens cannot be found; "
                                "mark assistant text with {% generation %} ... {% endgeneration %} in the template "
                                "(data.chat_template) or set data.loss_on=all")
            # The assistant header (add_generation_prompt) is the template's, not the message's: no loss
            # on it where the template renders it; else the message's text starts after messages[:i].
            for before in (self._render(messages[:i], header=True), self._render(messages[:i])):
                if upto.startswith(before):
                    break
            else:
                raise DataError(f"{where}: the chat template renders the messages before assistant message {i} "
                                "differently alone than followed by it, so its tokens cannot be found; mark "
                                "assistant text with {% generation %} ... {% endgeneration %} in the template "
                                "(data.chat_template) or set data.loss_on=all")
            spans.append((len(before), len(upto)))
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=bool)
        for start, end in spans:  # a token holding any character of the message's text
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        return ids, mask
