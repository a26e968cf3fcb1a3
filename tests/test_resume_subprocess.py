"""A checkpoint resumed in another Python process, from the file alone plus the same model (rebuilt
there from the same config and seed, or loaded from the same folder), gives the output of the run
never stopped, bit for bit: every diffusers pipeline kind the tests build (the home-made loops of
the stop tests too), a stateful cache hook, CPU offload, and text (sampling, a sliding-window cache,
the pipeline over a list)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from diffusers import EulerAncestralDiscreteScheduler, TaylorSeerCacheConfig
from safetensors.torch import load_file
from test_diffusers_kinds import FLUX_CALL, KINDS  # tests/ is on sys.path under pytest
from test_resume_diffusers import _home_made, output_tensor

import stopcock
from tiny import image as tiny
from tiny.text import sliding_window_model

ROOT = Path(__file__).resolve().parent.parent

# What the child runs: for each case, build the target as the parent did (the same builders, from this
# module), load its checkpoint, resume it, and write the output. Only the model (rebuilt from the same
# config and seed, or loaded from the same folder) and the checkpoint file cross the process boundary.
CHILD = r"""
import json, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
import stopcock

sys.path.insert(0, "tests")
from test_resume_subprocess import diffusion_cases, output_tensor, text_targets

folder, text_dir = Path(sys.argv[1]), sys.argv[2]
builders = {name: build for name, (build, _) in diffusion_cases().items()}
texts = text_targets(text_dir)
results = {}
for path in sorted(folder.glob("*.safetensors")):
    name = path.stem
    if name.endswith(".out"):
        continue
    checkpoint = stopcock.Checkpoint.load(path)
    torch.manual_seed(12345)  # a fresh process: its RNG is anywhere
    if name in builders:
        outcome = stopcock.resume(builders[name](), checkpoint)
        output = output_tensor(outcome.output).contiguous()
    else:
        target, given = texts[name]
        outcome = stopcock.resume(target, checkpoint, **given)
        output = outcome.output
    if isinstance(output, torch.Tensor):
        save_file({"out": output}, str(folder / f"{name}.out.safetensors"))
    else:
        (folder / f"{name}.out.json").write_text(json.dumps(output))
    results[name] = outcome.resumed
print(json.dumps(results))
"""


def diffusion_cases() -> dict[str, tuple[Any, dict[str, Any]]]:
    """Each case: a builder of the pipeline and its call (a generator is added): every kind the stop
    tests build, the home-made loops, an ancestral scheduler, CPU offload and a TaylorSeer cache."""

    def ancestral() -> Any:
        pipe = tiny.stable_diffusion_pipeline()
        pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)
        return pipe

    def offloaded() -> Any:
        pipe = tiny.stable_diffusion_pipeline()
        pipe.enable_model_cpu_offload(device="cpu")
        return pipe

    def taylorseer() -> Any:
        pipe = tiny.flux_pipeline()
        config = TaylorSeerCacheConfig(
            cache_interval=2, disable_cache_before_step=1, taylor_factors_dtype=torch.float32
        )
        pipe.transformer.enable_cache(config)
        return pipe

    pt = {"output_type": "pt"}
    cases: dict[str, tuple[Any, dict[str, Any]]] = {k.name: (k.build, {**k.call, **pt}) for k in KINDS}
    cases.update(
        {
            "ancestral-sd": (ancestral, {**pt, "prompt": "a cat"}),
            "offloaded-sd": (offloaded, {**pt, "prompt": "a cat"}),
            "taylorseer-flux": (taylorseer, {**FLUX_CALL, "output_type": "latent"}),
        }
    )
    return {**cases, **{name: (build, {}) for name, build in _home_made().items()}}


def text_targets(folder: str) -> dict[str, tuple[Any, dict[str, Any]]]:
    """The text cases' targets (and the arguments a checkpoint file cannot hold, given again)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return {
        "sampling": (model, {"tokenizer": tokenizer}),
        "sliding": (sliding_window_model(), {}),
        "pipeline-list": (pipeline("text-generation", model=model, tokenizer=tokenizer), {}),
    }


def _save(tmp_path: Path, name: str, outcome: stopcock.Outcome) -> None:
    assert outcome.stopped and outcome.checkpoint is not None
    outcome.checkpoint.save(tmp_path / f"{name}.safetensors")


def test_resume_in_another_process_is_bit_identical(tmp_path, text_model_dir, one_torch_thread):
    expected: dict[str, Any] = {}
    for name, (build, call) in diffusion_cases().items():
        kwargs = {**call, "num_inference_steps": 5}
        pipe = build()
        expected[name] = output_tensor(pipe(**kwargs, generator=torch.Generator().manual_seed(0)))
        _save(
            tmp_path,
            name,
            stopcock.run(
                pipe,
                **kwargs,
                generator=torch.Generator().manual_seed(0),
                stop=stopcock.max_steps(2),
                checkpoint=True,
            ),
        )

    targets = text_targets(str(text_model_dir))
    tokenizer = targets["sampling"][1]["tokenizer"]
    batch = tokenizer(["The quick brown fox", "Stop"], return_tensors="pt", padding=True)
    calls: dict[str, tuple[tuple[Any, ...], dict[str, Any], int]] = {
        "sampling": (
            (),
            {**batch, "max_new_tokens": 14, "do_sample": True, "top_k": 0, "tokenizer": tokenizer},
            6,
        ),
        "sliding": ((torch.tensor([[5, 6, 7, 8, 9, 10]]),), {"max_new_tokens": 12, "do_sample": False}, 7),
        "pipeline-list": (
            (["Once upon a time", "The quick", "Hello"],),
            {"max_new_tokens": 6, "do_sample": False},
            9,
        ),
    }
    for name, (args, kwargs, at) in calls.items():
        target = targets[name][0]
        torch.manual_seed(3)
        expected[name] = stopcock.run(target, *args, **kwargs).output
        torch.manual_seed(3)
        _save(
            tmp_path,
            name,
            stopcock.run(target, *args, **kwargs, stop=stopcock.max_steps(at), checkpoint=True),
        )

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), str(text_model_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    resumed = json.loads(child.stdout.strip().splitlines()[-1])
    assert sorted(resumed) == sorted(expected)
    assert all(r["exact"] and r["saved_steps"] > 0 for r in resumed.values()), resumed
    for name, want in expected.items():
        if isinstance(want, torch.Tensor):
            assert torch.equal(load_file(str(tmp_path / f"{name}.out.safetensors"))["out"], want), name
        else:
            assert json.loads((tmp_path / f"{name}.out.json").read_text()) == want, name
