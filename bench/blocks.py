"""3. Per-block abort on deeper models: a stop inside one step, where sub-step latency shows.

A step-level stop (the native criterion or interrupt, stopcock's finish mode) waits for the rest
of the current forward (and, for diffusers, the VAE decode), so its latency falls as the stop lands
deeper in the step; abort mode leaves the forward at the next module call, so its latency stays
under one block wherever the stop lands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .common import CPU, RANDOM_WEIGHTS, Device, Section, Table, deep_flux_pipeline, middle_block, ms
from .latency import ARMS, COLUMNS, add_rows, image_scenario, measure, text_scenario, unit_seconds


@dataclass(frozen=True)
class Config:
    gpt2: tuple[int, int, int]  # (n_layer, n_embd, n_head)
    prompt_tokens: int
    new_tokens: int
    stop_token: int  # the forward (0 is the prefill) in which the stop is requested
    depths: tuple[float, ...]  # which block: 0 the first, 1 the last
    dit: tuple[int, int]  # Flux transformer: (double-stream blocks, single-stream blocks)
    dit_steps: int
    dit_stop_step: int
    reps: int


QUICK = Config(gpt2=(2, 64, 2), prompt_tokens=16, new_tokens=6, stop_token=3, depths=(0.0,),
               dit=(1, 2), dit_steps=3, dit_stop_step=1, reps=1)
FULL = Config(gpt2=(24, 512, 8), prompt_tokens=16, new_tokens=10, stop_token=5, depths=(0.0, 0.5, 0.9),
              dit=(8, 16), dit_steps=6, dit_stop_step=3, reps=5)


def _gpt2(c: Config, data: dict[str, Any], device: Device) -> Table:
    n_layer, n_embd, _ = c.gpt2
    table = Table(f"GPT-2 {n_layer}x{n_embd}: stop requested inside the forward of token {c.stop_token + 1}",
                  [col.format(unit="steps") for col in COLUMNS])
    for depth in c.depths:
        s = text_scenario(c.gpt2, c.prompt_tokens, c.new_tokens, at_call=c.stop_token, block_fraction=depth,
                          device=device)
        measure(s, c.reps)
        data[f"gpt2 {s.where}"] = add_rows(table, s, unit_seconds(s, first=False))
    return table


def _dit(c: Config, data: dict[str, Any], device: Device) -> tuple[Table, str]:
    pipe = deep_flux_pipeline(*c.dit, device=device)
    n_blocks = sum(c.dit)
    trigger = middle_block(pipe.transformer) + ".attn"  # a single-stream block: its attention is mid-block
    s = image_scenario(
        f"Flux DiT, {n_blocks} blocks, 32x32", pipe, pipe.transformer, trigger,
        c.dit_steps, c.dit_stop_step, device, height=32, width=32, max_sequence_length=32,
    )
    measure(s, c.reps)
    table = Table(f"Flux-style DiT ({n_blocks} blocks): stop requested inside step {c.dit_stop_step + 1}"
                  f" of {c.dit_steps}", [col.format(unit="steps") for col in COLUMNS])
    data["dit"] = add_rows(table, s, unit_seconds(s, first=False))
    return table, s.where


def run(quick: bool = False, device: Device = CPU) -> Section:
    c = QUICK if quick else FULL
    n_layer, n_embd, _ = c.gpt2
    data: dict[str, Any] = {}
    gpt2_table = _gpt2(c, data, device)
    dit_table, dit_where = _dit(c, data, device)
    return Section(
        title="3. Per-block abort on deeper models",
        intro=(
            f"A {n_layer}-block GPT-2 (n_embd {n_embd}) decoding {c.new_tokens} tokens greedily after a"
            f" {c.prompt_tokens}-token prompt, stopped in the forward that produces token"
            f" {c.stop_token + 1} before the MLP of a block; and a Flux pipeline with a"
            f" {sum(c.dit)}-block transformer (128 channels) running {c.dit_steps} steps, stopped in"
            f" step {c.dit_stop_step + 1} before {dit_where}. Both stops land halfway through a block,"
            " where abort mode waits only for the module in flight (the attention or MLP the trigger"
            " precedes is the next module call). A forward pre-hook holds the run until"
            f" another thread has called `stop()`. Median of {c.reps} runs per arm, interleaved."
            " *In steps* divides by the median step of the runs without a stop, *in blocks* by a"
            " step / the number of blocks."
        ),
        tables=[gpt2_table, dit_table],
        notes=[
            "The row *no stop* is the rest of the run from the same moment, for scale.",
            "Abort mode arms a check before every module call once the stop is requested (nothing is"
            " installed before), so it returns at the next module call, within a block; step-level"
            " stops finish the forward first (and keep its token, or decode the latents).",
            RANDOM_WEIGHTS,
        ],
        data=data,
        headline=_headline(data, n_layer, sum(c.dit)),
    )


def _headline(data: dict[str, Any], gpt2_blocks: int, dit_blocks: int) -> list[str]:
    gpt2 = [v for k, v in data.items() if k.startswith("gpt2")]
    dit = data["dit"]
    if ARMS[3] not in dit or not gpt2:
        return []
    abort = [d[ARMS[3]]["in_blocks"] for d in gpt2]
    native = [d["native"]["in_blocks"] for d in gpt2]
    return [
        f"Abort inside a decoding step of a {gpt2_blocks}-block GPT-2: {min(abort):.1f} to {max(abort):.1f}"
        f" blocks after `stop()`, against {min(native):.1f} to {max(native):.1f} blocks for the native"
        " criterion, depending on where in the step the stop lands.",
        f"Inside a denoising step of a {dit_blocks}-block DiT: abort {ms(dit[ARMS[3]]['latency_s'])} ms"
        f" ({dit[ARMS[3]]['in_blocks']:.1f} blocks), native interrupt {ms(dit['native']['latency_s'])} ms"
        f" ({dit['native']['in_units']:.2f} steps, decode included), stopcock finish"
        f" {ms(dit[ARMS[2]]['latency_s'])} ms.",
    ]
