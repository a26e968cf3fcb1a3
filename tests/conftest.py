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


# -- diffusers (stopcock.tiny.image) --------------------------------------------------------------
@pytest.fixture(scope="session")
def image_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Stable Diffusion pipeline saved with save_pretrained (64x64 images)."""
    from stopcock.tiny.image import build_image_model

    return build_image_model(tmp_path_factory.mktemp("tiny-sd"))


@pytest.fixture(scope="session")
def image_pipe(image_model_dir):
    """The saved tiny Stable Diffusion pipeline, loaded (progress bar off). Shared: do not modify."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(image_model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def count_forwards():
    """``count_forwards(*modules)``: a dict counting each module's completed forward calls, by module."""
    handles = []

    def install(*modules):
        counts = {m: 0 for m in modules}

        def hook(module, args, output):
            counts[module] += 1

        handles.extend(m.register_forward_hook(hook) for m in modules)
        return counts

    yield install
    for handle in handles:
        handle.remove()
