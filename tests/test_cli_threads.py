"""The command line's torch threads: 1 on the built-in demo models (as the demo runs them), torch's own
default on a model you pass, and ``--threads N`` in every case; ``--help`` says so."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from stopcock.cli import build_parser


@pytest.fixture
def threads_restored() -> Iterator[None]:
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", ["text", "image", "resume", "demo"])
def test_help_says_how_many_threads_and_how_to_change_it(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]  # type: ignore[union-attr]
    help_text = " ".join(sub.format_help().split())
    assert "--threads N torch threads (default: 1" in help_text
    if command != "demo":
        assert "for the built-in demo models" in help_text
        assert "for a model you pass, torch's default" in help_text


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("threads_restored")
@pytest.mark.parametrize(("args", "expected"), [((), 1), (("--threads", "3"), 3)])
def test_text_on_the_demo_model_runs_on_one_thread_unless_told(run_main, args, expected):
    torch.set_num_threads(2)  # not what any case expects: the command must set it
    code, out, _ = run_main("text", "--prompt", "Beautiful is", "--max-new-tokens", "3", "--json", *args)
    assert code == 0
    assert json.loads(out)["threads"] == expected == torch.get_num_threads()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("threads_restored")
def test_image_on_the_demo_model_takes_threads(run_main, tmp_path):
    torch.set_num_threads(1)
    code, out, _ = run_main("image", "--prompt", "7", "--steps", "2", "--out", str(tmp_path / "x.png"),
                            "--threads", "2", "--json")
    assert code == 0
    assert json.loads(out)["threads"] == 2 == torch.get_num_threads()


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("threads_restored")
def test_a_model_you_pass_keeps_torchs_threads_unless_told(run_main, text_model_dir):
    torch.set_num_threads(2)
    text = ("text", "--model", str(text_model_dir), "--prompt", "hello", "--max-new-tokens", "2", "--json")
    code, out, _ = run_main(*text)
    assert code == 0 and json.loads(out)["threads"] == 2
    code, out, _ = run_main(*text, "--threads", "1")
    assert code == 0 and json.loads(out)["threads"] == 1


def test_threads_must_be_a_positive_integer(run_main):
    with pytest.raises(SystemExit) as exited:
        run_main("text", "--prompt", "x", "--threads", "0")
    assert exited.value.code == 2


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("threads_restored")
@pytest.mark.parametrize(("args", "expected"), [((), 1), (("--threads", "2"), 2)])
def test_serve_runs_the_demo_models_on_one_thread_unless_told(args, expected):
    from stopcock.server import serve

    parser = build_parser()
    torch.set_num_threads(3)
    backends = serve._load(parser.parse_args(["serve", *args]), [])
    assert set(backends) == {"text", "image"}
    assert torch.get_num_threads() == expected


def test_serve_help_says_how_many_threads():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["serve"]  # type: ignore[union-attr]
    help_text = " ".join(sub.format_help().split())
    assert "--threads N torch threads (default: 1 when serving the built-in demo models" in help_text
