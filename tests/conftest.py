"""Shared fixtures: tiny real models built offline once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory):
    from stopcock.tiny.text import build_text_model

    return build_text_model(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def text_model(text_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(text_model_dir).eval()


@pytest.fixture(scope="session")
def tokenizer(text_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(text_model_dir)


@pytest.fixture(scope="session")
def text_pipe(text_model, tokenizer):
    from transformers import pipeline

    return pipeline("text-generation", model=text_model, tokenizer=tokenizer)
