"""Shared fixtures: tiny real models built offline once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory):
    from tiny.text import build_text_model

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


# -- diffusers (tiny.image) --------------------------------------------------------------
@pytest.fixture(scope="session")
def image_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Stable Diffusion pipeline saved with save_pretrained (64x64 images)."""
    from tiny.image import build_image_model

    return build_image_model(tmp_path_factory.mktemp("tiny-sd"))


@pytest.fixture(scope="session")
def image_pipe(image_model_dir):
    """The saved tiny Stable Diffusion pipeline, loaded (progress bar off). Shared: do not modify."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(image_model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def server_backends(text_pipe, image_pipe):
    """The generation service's backends over the tiny models ("tiny-text", "tiny-sd")."""
    from stopcock.server.backends import ImageBackend, TextBackend

    return {"text": TextBackend(text_pipe, "tiny-text"), "image": ImageBackend(image_pipe, "tiny-sd")}


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (servers run several workers on few cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


# -- the command line (tests/test_cli*.py) ------------------------------------------------
CLI_PROMPT = "Beautiful is"


@pytest.fixture(scope="session")
def zen_text():
    """The demo text model's greedy continuation of CLI_PROMPT after n tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stopcock.tiny.demo import demo_model

    model = AutoModelForCausalLM.from_pretrained(demo_model("text")).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_model("text"))
    inputs = tokenizer(CLI_PROMPT, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    return lambda n: tokenizer.decode(new[:n], skip_special_tokens=True)


@pytest.fixture
def run_main(capsys):
    """Run ``stopcock.cli.main(args)`` in this process (quicker): returns (exit code, stdout, stderr)."""

    def call(*args: str) -> tuple[int, str, str]:
        from stopcock.cli import main

        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return call


