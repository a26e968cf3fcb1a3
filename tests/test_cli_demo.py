"""``stopcock demo`` (the README's main command, run here as CI runs it) and the demo models."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from stopcock.tiny import demo


def test_demo_command_shows_every_stop_path(tmp_path):
    out = tmp_path / "demo.png"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "stopcock", "demo", "--out", str(out)], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout
    assert "'Beautiful is better than ugly.'" in lines  # the trained model's words, cut at the stop string
    for reason in ("stopped (stop_string)", "stopped (timeout)", "stopped (user)", "completed after 20 of 20",
                   "stopped (max_steps) after 8 of 20 steps", "mode abort"):
        assert reason in lines
    assert "trained on the Zen of Python" in lines
    assert "trained on scikit-learn's 8x8 handwritten digits" in lines
    assert "Every run ended for the reason it should." in lines
    with Image.open(out) as sheet:
        panels = json.loads(sheet.text["stopcock"])
    assert [p["reason"] for p in panels.values()] == ["completed", "max_steps", "max_steps"]
    assert [p["partial"] for p in panels.values()] == [None, "raw", "denoised"]


@pytest.mark.parametrize(("kind", "weights"), [("text", "model.safetensors"),
                                               ("image", "unet/diffusion_pytorch_model.safetensors")])
def test_demo_models_ship_with_the_package(kind, weights):
    folder = demo.demo_model(kind)
    assert (folder / weights).is_file()
    assert sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) < 2_000_000  # small to commit


def test_the_demo_image_model_draws_the_digit_asked_for():
    """The trained model's images must be recognisable: compared with scikit-learn's mean image of each
    digit, a generated "0" is nearest to the mean 0 and a generated "7" to the mean 7."""
    import torch
    from diffusers import DiffusionPipeline
    from sklearn.datasets import load_digits

    pipe = DiffusionPipeline.from_pretrained(demo.demo_model("image"))
    pipe.set_progress_bar_config(disable=True)
    data = load_digits()
    means = torch.stack([torch.tensor(data.images[data.target == d]).float().mean(0) / 16 for d in range(10)])
    for digit in (0, 7):
        image = pipe(str(digit), num_inference_steps=20, generator=torch.Generator().manual_seed(0),
                     output_type="pt").images[0]
        small = torch.nn.functional.avg_pool2d(image.mean(0, keepdim=True)[None], 2)[0, 0]  # 16x16 -> 8x8
        small = (small - small.min()) / (small.max() - small.min())
        distances = ((means - small) ** 2).flatten(1).sum(1)
        assert int(distances.argmin()) == digit


def test_unknown_demo_model_kind():
    with pytest.raises(ValueError, match="'text', 'image'"):
        demo.demo_model("audio")
