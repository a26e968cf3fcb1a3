"""``make gpu-check``: stopcock on one GPU with models of real size, in float16 and bfloat16.

``python -m bench.gpu_check [--out bench/RESULTS-gpu.md] [--cpu-smoke]`` builds, from configs with
random weights (no model hub), a causal LM of about 0.5B parameters (Llama layout: 32 layers of
width 1024) and an SD-1.5-sized UNet (320/640/1280/1280 channels, 64x64 latents) inside the tiny
Stable Diffusion pipeline (its small VAE and text encoder), and measures, per dtype:

- overhead: the plain call against ``stopcock.run(..., stop=StopSignal())`` in finish and abort
  mode (medians of interleaved, CUDA-synchronised calls; the ratio to the plain call);
- host-device synchronisations a run adds per step (torch's CUDA sync debug mode, at n and 2n
  steps: what grows with the steps; expected 0);
- abort latency: a stop from another thread in the middle of a step, until the run has returned
  and the GPU is idle (``torch.cuda.synchronize()``), not only until Python returns;
- batched server throughput: ``bench.server`` with the 0.5B model (tokens/s batched against one
  at a time, at 1, 4 and 16 clients).

Without CUDA it prints one line saying so and exits 0. ``--cpu-smoke`` runs the same code on the
CPU with tiny models in seconds (the test suite's check that the script works), writing nothing
unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .common import CPU, Device, Probe, Section, Table, interleaved, median, stop_from_thread

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS-gpu.md"
DTYPES = ("float16", "bfloat16")


def causal_lm(device: Device, small: bool = False) -> tuple[Any, Any]:
    """A random-weight Llama-layout causal LM (about 0.5B parameters; ``small``: a tiny one) and the
    tiny tokenizer, on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny.text import build_tokenizer

    tokenizer = build_tokenizer()
    width, layers, ffn, heads = (64, 2, 128, 2) if small else (1024, 32, 4096, 16)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=width, num_hidden_layers=layers, intermediate_size=ffn,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device.name):
        model = LlamaForCausalLM(config).to(device.torch_dtype).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    model.generation_config.eos_token_id = None  # random weights: an end of sequence would mean nothing
    return model, tokenizer


def sd_pipeline(device: Device, small: bool = False) -> tuple[Any, int]:
    """The tiny SD pipeline with an SD-1.5-sized UNet (``small``: its own tiny one) on ``device``, and
    the image side that gives 64x64 latents."""
    from diffusers import UNet2DConditionModel

    from tiny.image import stable_diffusion_pipeline

    pipe = stable_diffusion_pipeline()
    pipe.set_progress_bar_config(disable=True)
    scale = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
    if small:
        return device.place(pipe), 64
    torch.manual_seed(0)
    pipe.unet = UNet2DConditionModel(
        sample_size=64, in_channels=pipe.unet.config.in_channels, out_channels=pipe.unet.config.out_channels,
        block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, attention_head_dim=8,
        cross_attention_dim=pipe.text_encoder.config.hidden_size,
    )
    return device.place(pipe), 64 * scale


def _timed(fn: Callable[[], object], device: Device) -> Callable[[], float]:
    def call() -> float:
        device.sync()
        start = time.perf_counter()
        fn()
        device.sync()
        return time.perf_counter() - start

    return call


def _arms(target: Any, call: Callable[..., object], args: tuple[Any, ...], kwargs: dict[str, Any]
          ) -> dict[str, Callable[[], object]]:
    """The plain ``call(*args, **kwargs)`` and ``stopcock.run`` of ``target`` in both modes."""
    import stopcock

    return {
        "plain call": lambda: call(*args, **kwargs),
        "run, finish": lambda: stopcock.run(target, *args, stop=stopcock.StopSignal(), **kwargs),
        "run, abort": lambda: stopcock.run(target, *args, stop=stopcock.StopSignal(), mode="abort", **kwargs),
    }


def _syncs(arms_at: Callable[[int], dict[str, Callable[[], object]]], steps: int) -> dict[str, float]:
    """Syncs stopcock adds per step: the growth of each arm's excess over the plain call from ``steps``
    to ``2 * steps`` steps, per step (0 without CUDA: nothing to count)."""
    if not torch.cuda.is_available():
        return dict.fromkeys(arms_at(steps), 0.0)
    from .overhead import count_syncs

    short, long = arms_at(steps), arms_at(2 * steps)
    counts = {name: (count_syncs(short[name]), count_syncs(long[name])) for name in short}
    plain = counts["plain call"]
    return {name: ((b - plain[1]) - (a - plain[0])) / steps for name, (a, b) in counts.items()}


def _abort_latency(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], probe: Probe,
                   device: Device) -> float:
    """Seconds from a stop (abort mode, from another thread, inside a forward) to the GPU idle."""
    import stopcock

    signal = stopcock.StopSignal()
    timing = stop_from_thread(lambda: stopcock.run(target, *args, stop=signal, mode="abort", **kwargs),
                              signal.stop, probe, device)
    return timing.latency


def _measure(device: Device, small: bool, reps: int) -> dict[str, Any]:
    found = {"text": _text(device, small, reps), "image": _image(device, small, reps)}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return found


def _text(device: Device, small: bool, reps: int) -> dict[str, Any]:
    model, tokenizer = causal_lm(device, small)
    ids = tokenizer(["The quick brown fox jumps over the lazy dog."], return_tensors="pt").input_ids
    ids = ids.to(device.name)
    mask = torch.ones_like(ids)

    def text_kwargs(tokens: int) -> dict[str, Any]:
        return {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False,
                "attention_mask": mask}

    def text_arms(tokens: int) -> dict[str, Callable[[], object]]:
        return _arms(model, model.generate, (ids,), text_kwargs(tokens))

    tokens = 16 if small else 128
    times = interleaved({k: _timed(f, device) for k, f in text_arms(tokens).items()}, reps)
    layers = model.model.layers
    size = sum(p.numel() for p in model.parameters()) / 1e9
    return {
        "label": f"causal LM, {size:.2f}B parameters, {tokens} tokens",
        "times": {k: median(v) for k, v in times.items()},
        "syncs": _syncs(text_arms, 8),
        "abort": median([_abort_latency(model, (ids,), text_kwargs(4 * tokens),
                                        Probe(layers[0], layers[len(layers) // 2], 20), device)
                         for _ in range(reps)]),
    }


def _image(device: Device, small: bool, reps: int) -> dict[str, Any]:
    pipe, side = sd_pipeline(device, small)

    def image_kwargs(steps: int) -> dict[str, Any]:
        return {"prompt": "a red circle", "num_inference_steps": steps, "height": side, "width": side,
                "output_type": "latent", "generator": torch.Generator().manual_seed(0)}

    def image_arms(steps: int) -> dict[str, Callable[[], object]]:
        return _arms(pipe, pipe, (), image_kwargs(steps))

    steps = 4 if small else 20
    times = interleaved({k: _timed(f, device) for k, f in image_arms(steps).items()}, reps)
    unet = pipe.unet
    return {
        "label": f"UNet, {sum(p.numel() for p in unet.parameters()) / 1e9:.2f}B parameters, {steps} steps,"
                 f" {side}x{side} pixels ({side // (side // 64)}x{side // (side // 64)} latents)",
        "times": {k: median(v) for k, v in times.items()},
        "syncs": _syncs(image_arms, 4),
        "abort": median([_abort_latency(pipe, (), image_kwargs(50), Probe(unet, unet.mid_block, 5), device)
                         for _ in range(reps)]),
    }


def check(device_name: str = "cuda", small: bool = False) -> list[Section]:
    sections = []
    reps = 2 if small else 5
    table = Table("Overhead, syncs and abort latency (random weights, built from configs)",
                  ["dtype", "model", "plain call", "run finish / plain", "run abort / plain",
                   "syncs added per step (finish, abort)", "abort: stop to GPU idle"])
    data: dict[str, Any] = {}
    dtypes = ("float32",) if small else DTYPES
    for dtype in dtypes:
        device = Device(device_name, dtype)
        data[dtype] = found = _measure(device, small, reps)
        for kind in ("text", "image"):
            f = found[kind]
            t = f["times"]
            table.add(dtype, f["label"], f"{t['plain call'] * 1000:.1f} ms",
                      f"{t['run, finish'] / t['plain call']:.3f}", f"{t['run, abort'] / t['plain call']:.3f}",
                      f"{f['syncs']['run, finish']:+.2f}, {f['syncs']['run, abort']:+.2f}",
                      f"{f['abort'] * 1000:.1f} ms")
    sections.append(Section("GPU check", f"On {Device(device_name, dtypes[0]).describe()}.", tables=[table],
                            data=data))
    from . import server

    if small:
        sections.append(server.run(quick=True, images=False))
    else:
        sections.append(server.run(quick=False, device=Device(device_name, "float16"), images=False))
    return sections


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="the report (default on a GPU: bench/RESULTS-gpu.md)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny models on the CPU: checks the script")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("gpu-check: skipped: no CUDA device here (torch.cuda.is_available() is False);"
              " run `make gpu-check` on a machine with an NVIDIA GPU and a CUDA build of torch")
        return 0
    start = time.perf_counter()
    sections = check(CPU.name if args.cpu_smoke else "cuda", small=args.cpu_smoke)
    report = "\n\n".join(
        ["# stopcock on a GPU", f"Generated by `make gpu-check` (`python -m bench.gpu_check`) in"
         f" {time.perf_counter() - start:.0f} s. Do not edit: rerun it.", *(s.markdown() for s in sections)]
    ) + "\n"
    out = args.out or (None if args.cpu_smoke else RESULTS)
    if out is None:
        print(report)
    else:
        out.write_text(report)
        print(f"gpu-check: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
