"""Fixtures the application tests share."""

import pytest
from tiny_models import tiny_model


@pytest.fixture
def model_dir(tmp_path):
    """A local Hugging Face model folder (tiny llama, vocabulary 300) without tokenizer files: `oomb train`
    falls back to its byte-level tokenizer (257 ids)."""
    folder = tmp_path / "model"
    tiny_model("llama", vocab_size=300).save_pretrained(folder)
    return folder
