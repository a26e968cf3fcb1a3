"""``stopcock demo`` (the README's main command, run here as CI runs it) and the demo-model cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from stopcock.tiny import demo


def test_demo_command_shows_every_stop_path(tmp_path):
    out = tmp_path / "demo.png"
    cache = tmp_path / "cache"
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "stopcock.cli", "demo", "--out", str(out)], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout
    assert "'Beautiful is better than ugly.'" in lines  # the trained model's words, cut at the stop string
    for reason in ("stopped (stop_string)", "stopped (timeout)", "stopped (user)", "completed after 20 of 20",
                   "stopped (max_steps) after 8 of 20 steps", "mode abort"):
        assert reason in lines
    assert "random weights" in lines  # said plainly
    assert "Every run ended for the reason it should." in lines
    with Image.open(out) as sheet:
        panels = json.loads(sheet.text["stopcock"])
    assert [p["reason"] for p in panels.values()] == ["completed", "max_steps", "max_steps"]
    assert [p["partial"] for p in panels.values()] == [None, "raw", "denoised"]
    assert (cache / "stopcock" / f"demo-image-v{demo.DEMO_VERSION}").is_dir()  # built in the cache


def test_demo_image_model_is_built_once_and_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    builds: list[Path] = []

    def failing(folder: Path) -> Path:
        (folder / "half-written").write_text("x")
        raise RuntimeError("build interrupted")

    def counting(folder: Path) -> Path:
        builds.append(folder)
        (folder / "model_index.json").write_text("{}")
        return folder

    monkeypatch.setattr(demo, "_build_image", failing)
    with pytest.raises(RuntimeError, match="build interrupted"):
        demo.demo_model("image")
    assert list((tmp_path / "stopcock").iterdir()) == []  # nothing half-written left, nor taken for a model

    monkeypatch.setattr(demo, "_build_image", counting)
    first = demo.demo_model("image")
    second = demo.demo_model("image")
    assert first == second == tmp_path / "stopcock" / f"demo-image-v{demo.DEMO_VERSION}"
    assert len(builds) == 1 and builds[0] != first  # built aside, then renamed into place
    assert (first / "model_index.json").is_file()
    assert [p.name for p in (tmp_path / "stopcock").iterdir()] == [first.name]


def test_demo_text_model_ships_with_the_package():
    assert (demo.demo_model("text") / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="'text', 'image'"):
        demo.demo_model("audio")
