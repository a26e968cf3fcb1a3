"""3. Per-block abort on a deeper model: a stop inside one decoding step, at several depths.

A step-level stop (the native criterion, stopcock's finish mode) waits for the rest of the current
forward, so its latency falls as the stop lands deeper in the step; abort mode leaves the forward
at the next block, so its latency stays about one block wherever the stop lands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .common import RANDOM_WEIGHTS, Section, Table
from .latency import ARMS, COLUMNS, add_rows, measure, text_scenario, unit_seconds


@dataclass(frozen=True)
class Config:
    model: tuple[int, int, int]  # (n_layer, n_embd, n_head)
    prompt_tokens: int
    new_tokens: int
    stop_token: int  # the decoding step (forward number) in which the stop is requested
    depths: tuple[float, ...]  # where in the step: fraction of the blocks already entered
    reps: int


QUICK = Config(model=(2, 64, 2), prompt_tokens=16, new_tokens=6, stop_token=3, depths=(0.5,), reps=1)
FULL = Config(model=(24, 512, 8), prompt_tokens=16, new_tokens=10, stop_token=5, depths=(0.25, 0.5, 0.75),
              reps=7)


def run(quick: bool = False) -> Section:
    c = QUICK if quick else FULL
    n_layer, n_embd, _ = c.model
    table = Table(f"GPT-2 {n_layer}x{n_embd}: stop requested inside the forward of token {c.stop_token + 1}",
                  [col.format(unit="steps") for col in COLUMNS])
    data: dict[str, Any] = {}
    where = ""
    for depth in c.depths:
        block = min(n_layer - 1, int(depth * n_layer))
        s = text_scenario(
            f"inside block {block + 1} of {n_layer}", c.model, c.prompt_tokens, c.new_tokens,
            at_call=c.stop_token, block_fraction=depth,
        )
        where = s.where.split(" of block")[0]
        measure(s, c.reps)
        data[f"block {block + 1}"] = add_rows(table, s, unit_seconds(s, first=False))
    last = data[next(reversed(data))] if data else {}
    headline = []
    if ARMS[3] in last:
        first = data[next(iter(data))]
        headline.append(
            f"Abort inside a decoding step of a {n_layer}-block GPT-2: {first[ARMS[3]]['in_blocks']:.1f}"
            f" to {last[ARMS[3]]['in_blocks']:.1f} blocks after `stop()`, against"
            f" {first['native']['in_blocks']:.1f} to {last['native']['in_blocks']:.1f} blocks for"
            " the native criterion (which also keeps the token of that step)."
        )
    return Section(
        title="3. Per-block abort on a deeper model",
        intro=(
            f"A {n_layer}-block GPT-2 (n_embd {n_embd}), greedy decoding of {c.new_tokens} tokens"
            f" after a {c.prompt_tokens}-token prompt. A forward pre-hook holds the run until another"
            f" thread has called `stop()`, in the forward that produces token {c.stop_token + 1},"
            f" before {where} of the given block: halfway through it, where abort mode waits for the"
            f" rest of the block. Median of {c.reps} runs per arm, interleaved. *In steps* divides by"
            f" the median decoding step of the runs without a stop, *in blocks* by a step / {n_layer}."
        ),
        tables=[table],
        notes=[
            "The row *no stop* is the rest of the run from the same moment, for scale.",
            "Abort mode checks before every block (forward pre-hooks), so it returns within about"
            " one block; step-level stops finish the forward first and keep its token. A stop in the"
            " last block is seen at the end of that forward, as in finish mode.",
            RANDOM_WEIGHTS,
        ],
        data=data,
        headline=headline,
    )
