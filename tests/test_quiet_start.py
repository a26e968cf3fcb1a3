"""Start-up says only what a user can act on: no licence paragraph for a pipeline without a safety
checker, no torchvision fallback notices, no loading bars for the demo models; and a hub id that
cannot be loaded offline is one line naming the id and the fix. Real processes, real stderr."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stopcock.tiny.demo import demo_model

ROOT = Path(__file__).resolve().parent.parent
NOISE = ("safety checker", "Stable Diffusion license", "torchvision", "Loading weights",
         "Loading pipeline components", "Couldn't connect", "stacktrace")


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY")}
    # an empty Hugging Face cache: a hub id is never found there
    return {**env, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}


def _stopcock(*args: str, tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stopcock", *args], cwd=tmp_path, env=_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout)


def _noise_in(text: str) -> list[str]:
    return [n for n in NOISE if n in text]


@pytest.mark.timeout(300)
def test_demo_start_up_is_quiet(tmp_path):
    done = _stopcock("demo", "--out", str(tmp_path / "demo.png"), tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _noise_in(done.stderr + done.stdout) == []
    assert done.stderr == ""


@pytest.mark.timeout(300)
def test_serve_start_up_is_quiet(tmp_path):
    server = subprocess.Popen([sys.executable, "-m", "stopcock", "serve", "--port", "0"], cwd=tmp_path,
                              env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
    before: list[str] = []
    try:
        assert server.stderr is not None
        for line in server.stderr:  # the server says on stderr when it listens
            if "stopcock serve: running on http://" in line:
                break
            before.append(line)
        else:
            raise AssertionError(f"the server ended ({server.wait()}): {''.join(before)}")
    finally:
        server.terminate()
        server.communicate(timeout=60)
    assert _noise_in("".join(before)) == []
    # what comes before is uvicorn's own lines about the process
    assert all(line.startswith("INFO:") for line in before), before


@pytest.mark.timeout(300)
def test_a_pipeline_folder_without_its_safety_checker_loads_without_the_licence_paragraph(tmp_path):
    folder = tmp_path / "sd"
    shutil.copytree(demo_model("image"), folder)  # a folder of the user's: not quiet as the demo models are
    index = json.loads((folder / "model_index.json").read_text())
    index["requires_safety_checker"] = True  # as a Stable Diffusion folder saved without the checker says
    (folder / "model_index.json").write_text(json.dumps(index))
    done = _stopcock("image", "--model", str(folder), "--prompt", "7", "--steps", "2", "--progress", "none",
                     "--out", str(tmp_path / "x.png"), tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    # a model of the user's shows the libraries' loading bars, but not their notices
    assert "safety checker" not in done.stderr and "license" not in done.stderr
    assert "torchvision" not in done.stderr
    assert "stopcock: saved the complete image" in done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("command", "hub_id"), [("text", "gpt2"), ("image", "no-such-org/no-such-model")])
def test_an_offline_hub_id_is_one_line_naming_it_and_the_fix(tmp_path, command, hub_id):
    done = _stopcock(command, "--model", hub_id, "--prompt", "3", "--out" if command == "image" else "--json",
                     *([str(tmp_path / "x.png")] if command == "image" else []), tmp_path=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    error = f"stopcock: error: {hub_id!r} is not a local folder, and HF_HUB_OFFLINE is set"
    assert lines[0].startswith(error)
    assert "Pass a local folder" in lines[0] and "unset HF_HUB_OFFLINE" in lines[0]
    assert _noise_in(done.stderr) == []


def test_the_filter_is_gone_after_a_load(text_model_dir):
    from stopcock.loading import load_text_model

    load_text_model(str(text_model_dir), quiet=False)
    assert logging.getLogger("transformers.utils.import_utils").filters == []
