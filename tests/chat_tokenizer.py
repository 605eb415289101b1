"""A tiny word-level tokenizer with chat templates, built locally for the chat-data tests (no downloads)."""

from __future__ import annotations

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = ("hi hello there what is two plus three four five six seven one yes no ok thanks bye you are a helpful "
         "bot . ? ! the answer sum of and name my your tell me count to again sure good day").split()

# Each message is "<|role|> content <|end|> "; add_generation_prompt appends the assistant header.
PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|> {% endif %}")
# The same text, assistant content and its <|end|> marked with {% generation %}.
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}"
    "{{ m['content'] }} <|end|>{% endgeneration %} {% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> "
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
# Ignores add_generation_prompt: the prefix method then counts the assistant header as the message's.
NO_HEADER_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
# Ends the conversation with </s>: a prefix renders differently than inside the whole conversation.
END_MARK_TEMPLATE = PLAIN_TEMPLATE + "{% if not add_generation_prompt %}</s>{% endif %}"


def chat_tokenizer(template: str | None = PLAIN_TEMPLATE):
    """A fast tokenizer of len(SPECIALS) + len(WORDS) ids (< 64, the tiny preset's vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", model_max_length=2**62)
    out.chat_template = template
    return out
