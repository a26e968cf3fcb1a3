"""A checkpoint fingerprints what its target depends on, not what the saving process happened to
import: a text checkpoint saved by a process that had also imported diffusers resumes in a process
that never imports it, and the reverse; an image checkpoint saved by a process that also built and ran
a text model resumes in one that only imports diffusers, and the reverse. Each resume is bit-identical
to the run never stopped. Every save and every resume runs in its own fresh Python process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent

# role "both": imports transformers and diffusers, saves a text and an image checkpoint and the
# outputs of the runs never stopped; "text": transformers only (never diffusers), saves a text
# checkpoint and resumes the one "both" saved; "image": diffusers only, builds no text model, saves an
# image checkpoint and resumes the one "both" saved; "resume-both": resumes what "text" and "image" saved.
CHILD = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
import stopcock

role, folder, text_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)

def text_model():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(text_dir).eval()

def image_pipe():
    from tiny.image import ddpm_pipeline
    return ddpm_pipeline()

TEXT = dict(max_new_tokens=12, do_sample=True, top_k=0)
PROMPT = torch.tensor([[5, 6, 7, 8, 9]])

def text_run(model, **extra):
    torch.manual_seed(3)
    return stopcock.run(model, PROMPT, **TEXT, **extra)

def image_run(pipe, **extra):
    return stopcock.run(pipe, num_inference_steps=5, output_type="pt",
                        generator=torch.Generator().manual_seed(0), **extra)

def save_text(name, model):
    outcome = text_run(model, stop=stopcock.max_steps(5), checkpoint=True)
    assert outcome.stopped
    outcome.checkpoint.save(folder / f"{name}.safetensors")

def save_image(name, pipe):
    outcome = image_run(pipe, stop=stopcock.max_steps(2), checkpoint=True)
    assert outcome.stopped
    outcome.checkpoint.save(folder / f"{name}.safetensors")

def resume(name, target):
    torch.manual_seed(12345)  # a fresh process: the resume restores the RNG it needs
    outcome = stopcock.resume(target, stopcock.Checkpoint.load(folder / f"{name}.safetensors"))
    output = outcome.output if isinstance(outcome.output, torch.Tensor) else outcome.output.images
    save_file({"out": output.contiguous()}, str(folder / f"{name}.out.safetensors"))
    return outcome.resumed["exact"]

report = {}
if role == "both":
    import diffusers, transformers  # noqa: F401
    model, pipe = text_model(), image_pipe()
    save_file({"out": text_run(model).output}, str(folder / "text.reference.safetensors"))
    image = image_run(pipe).output.images.contiguous()
    save_file({"out": image}, str(folder / "image.reference.safetensors"))
    save_text("text-saved-with-both", model)
    save_image("image-saved-with-both", pipe)
elif role == "text":
    model = text_model()
    save_text("text-saved-alone", model)
    report["text-saved-with-both"] = resume("text-saved-with-both", model)
elif role == "image":
    pipe = image_pipe()
    save_image("image-saved-alone", pipe)
    report["image-saved-with-both"] = resume("image-saved-with-both", pipe)
else:
    import diffusers, transformers  # noqa: F401
    report["text-saved-alone"] = resume("text-saved-alone", text_model())
    report["image-saved-alone"] = resume("image-saved-alone", image_pipe())
report["imported"] = sorted(m for m in ("diffusers", "transformers") if m in sys.modules)
print(json.dumps(report))
"""


def _child(role: str, folder: Path, text_dir: Path) -> dict[str, object]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, role, str(folder), str(text_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"{role}: {done.stderr[-3000:]}"
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _out(folder: Path, name: str):
    return load_file(str(folder / f"{name}.safetensors"))["out"]


@pytest.mark.timeout(1500)
def test_checkpoints_cross_processes_with_other_imports(tmp_path, text_model_dir):
    import torch

    from stopcock.checkpoint import Checkpoint

    assert _child("both", tmp_path, text_model_dir)["imported"] == ["diffusers", "transformers"]
    saved = Checkpoint.load(tmp_path / "text-saved-with-both.safetensors")
    assert "diffusers" not in saved.fingerprint["versions"]  # the text target does not depend on it
    assert "transformers" in saved.fingerprint["versions"]

    text = _child("text", tmp_path, text_model_dir)
    assert text == {"text-saved-with-both": True, "imported": ["transformers"]}
    image = _child("image", tmp_path, text_model_dir)
    assert image["image-saved-with-both"] is True
    both = _child("resume-both", tmp_path, text_model_dir)
    imported = ["diffusers", "transformers"]
    assert both == {"text-saved-alone": True, "image-saved-alone": True, "imported": imported}

    for kind in ("text", "image"):
        reference = _out(tmp_path, f"{kind}.reference")
        for saved_by in ("saved-with-both", "saved-alone"):
            assert torch.equal(_out(tmp_path, f"{kind}-{saved_by}.out"), reference), (kind, saved_by)
    # the image checkpoints saved with and without a text model in the process carry the same versions
    alone = Checkpoint.load(tmp_path / "image-saved-alone.safetensors").fingerprint["versions"]
    with_both = Checkpoint.load(tmp_path / "image-saved-with-both.safetensors").fingerprint["versions"]
    assert alone == with_both and "diffusers" in alone
