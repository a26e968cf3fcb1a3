"""Stops that judge the output: ``python -m bench.quality [repetition] [converged] [--n N]``.

- repetition: tokens ``stopcock.repetition()`` saves on rows that loop (tiny random GPT-2s, which
  loop under greedy decoding) and the rows it changes among those that do not (the demo text model,
  greedy, on the first words of each line of the Zen of Python), for a grid of settings.
- converged: ``stopcock.converged()`` on the demo digits model (50-step runs, one image a run, fixed
  seeds; DDIM, Euler, DPM-Solver++; two tolerances) against the full run, shorter schedules (one of
  the same mean cost), and the naive rule on x_t: steps used, RMSE to the full run, same-digit
  diversity and the accuracy of a classifier trained on scikit-learn's digits, with bootstrap 95%
  intervals over the images.

The tables go into ``bench/RESULTS.md`` between this bench's markers (the rest of the file is left as
it is); the plot into ``bench/converged.png`` and ``docs/images/converged.png``.
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .common import Table, quiet

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
PLOT = HERE / "converged.png"
DOCS_PLOT = HERE.parent / "docs" / "images" / "converged.png"
START, END = "<!-- bench.quality: start -->", "<!-- bench.quality: end -->"

NEW_TOKENS = 128
#: (ngram, repeats, window) settings measured; the library's default is the first
REPETITION_GRID = [(4, 3, 64), (2, 3, 64), (3, 3, 64), (4, 2, 64), (6, 2, 64), (8, 2, 64), (4, 3, 32)]
LOOP_SEEDS = (0, 1, 2, 3)
LOOP_PROMPTS = [
    "Hello world",
    "The quick brown fox",
    "Stop the pipeline",
    "Once upon a time",
    "Numbers 0 1 2",
    "Unicode: café",
    "Generation ends at",
    "a small model",
]

FULL_STEPS = 50
SCHEDULES = (5, 10, 15, 20, 30)  # the shorter schedules of the plot
TOLERANCES = (0.05, 0.02)
PATIENCE = 2


# -- repetition ------------------------------------------------------------------------------------
def _new_tokens(rows: torch.Tensor, prompt_len: int, pad: int) -> list[list[int]]:
    out = []
    for row in rows[:, prompt_len:].tolist():
        while row and row[-1] == pad:
            row.pop()
        out.append(row)
    return out


def _repetition_runs(model: Any, tokenizer: Any, prompts: list[str]) -> tuple[list[list[int]], dict]:
    """The full greedy rows of ``prompts``, and for each setting of the grid the rows it kept."""
    import stopcock

    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    prompt_len = batch["input_ids"].shape[1]
    pad = tokenizer.pad_token_id
    full = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad)
    rows = _new_tokens(full, prompt_len, pad)
    kept = {}
    for setting in REPETITION_GRID:
        outcome = stopcock.run(
            model,
            **batch,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad,
            stop=stopcock.repetition(*setting),
            tokenizer=tokenizer,
        )
        kept[setting] = (_new_tokens(outcome.output, prompt_len, pad), outcome.row_reasons)
    return rows, kept


def bench_repetition() -> list[Table]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stopcock.loading import load_text_model, resolve_model
    from tiny.text import build_text_model
    from tiny.train import zen

    looping: list[tuple[list[list[int]], dict]] = []
    for seed in LOOP_SEEDS:
        folder = build_text_model(tempfile.mkdtemp(prefix="loop-"), seed=seed)
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        looping.append(_repetition_runs(model, AutoTokenizer.from_pretrained(folder), LOOP_PROMPTS))
    demo, tokenizer = load_text_model(resolve_model(None, "text"), quiet=True)
    tokenizer.padding_side = "left"
    lines = [line for line in zen().splitlines()[2:] if line.strip()]
    prompts = [" ".join(line.split()[:2]) for line in lines]
    plain_rows, plain_kept = _repetition_runs(demo, tokenizer, prompts)

    table = Table(
        f"repetition(): tokens saved on looping rows, rows changed on rows that do not loop (greedy,"
        f" {NEW_TOKENS} new tokens)",
        [
            "ngram, repeats, window",
            "looping rows ended (of)",
            "tokens generated, looping rows (without → with)",
            "tokens saved",
            "demo-model rows changed (of)",
            "kept rows equal the full run's start",
        ],
    )
    for setting in REPETITION_GRID:
        ended = total = before = after = 0
        prefixes = True
        for rows, kept in looping:
            cut, reasons = kept[setting]
            for full, row, reason in zip(rows, cut, reasons, strict=True):
                total += 1
                before += len(full)
                after += len(row)
                ended += reason == "repetition"
                prefixes = prefixes and full[: len(row)] == row
        cut, _ = plain_kept[setting]
        changed = sum(a != b for a, b in zip(plain_rows, cut, strict=True))
        prefixes = prefixes and all(a[: len(b)] == b for a, b in zip(plain_rows, cut, strict=True))
        label = ", ".join(map(str, setting)) + (" (default)" if setting == REPETITION_GRID[0] else "")
        table.add(
            label,
            f"{ended} ({total})",
            f"{before} → {after}",
            f"{1 - after / before:.0%}",
            f"{changed} ({len(plain_rows)})",
            "yes" if prefixes else "NO",
        )
    return [table]


# -- converged -------------------------------------------------------------------------------------
def _pixels(latents: torch.Tensor) -> np.ndarray:
    """The demo model's latents as 8x8 digit images in [0, 1] (its latents are the images)."""
    return ((latents.float().mean(dim=1) + 1) / 2).clamp(0, 1).reshape(latents.shape[0], -1).numpy()


def _classifier() -> tuple[Any, float, float]:
    """A classifier of scikit-learn's digits (pixels in [0, 1]), its 5-fold accuracy, and the real
    digits' same-digit diversity."""
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import cross_val_score

    data = load_digits()
    x, y = data.data / 16, data.target
    clf = LogisticRegression(max_iter=2000)
    accuracy = float(cross_val_score(clf, x, y, cv=5).mean())
    return clf.fit(x, y), accuracy, _diversity(x, y)


def _diversity(x: np.ndarray, labels: np.ndarray) -> float:
    """Mean pairwise L2 distance between images of the same digit, averaged over the digits."""
    out = []
    for d in range(10):
        group = x[labels == d]
        if len(group) > 1:
            dist = np.sqrt(((group[:, None] - group[None]) ** 2).sum(-1))
            out.append(dist[np.triu_indices(len(group), 1)].mean())
    return float(np.mean(out))


def _ci(values: np.ndarray, stat: Callable[[np.ndarray], float], rng: np.random.Generator) -> float:
    """Half the width of the bootstrap 95% interval of ``stat`` over ``values`` (resampled rows)."""
    n = len(values)
    draws = [stat(values[rng.integers(0, n, n)]) for _ in range(400)]
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float((hi - lo) / 2)


def _ci_halves(images: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> float:
    """The noise of the same-digit diversity: half the 95% range of its value over random halves of
    the images (drawn without replacement, so no image is paired with itself), divided by sqrt(2)."""
    n = len(images)
    draws = []
    for _ in range(200):
        pick = rng.permutation(n)[: n // 2]
        draws.append(_diversity(images[pick], labels[pick]))
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return float((hi - lo) / 2 / np.sqrt(2))


def _schedulers(pipe: Any) -> dict[str, Any]:
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler

    config = pipe.scheduler.config
    return {
        "DDIM": DDIMScheduler.from_config(config),
        "Euler": EulerDiscreteScheduler.from_config(config),
        "DPM-Solver++": DPMSolverMultistepScheduler.from_config(config, algorithm_type="dpmsolver++"),
    }


def _batched(pipe: Any, n: int, steps: int, chunk: int = 100) -> torch.Tensor:
    """The final latents of ``n`` images (digit ``i % 10``, seed ``i``), ``steps`` steps each."""
    out = []
    for start in range(0, n, chunk):
        ids = range(start, min(n, start + chunk))
        generators = [torch.Generator().manual_seed(i) for i in ids]
        result = pipe(
            [str(i % 10) for i in ids], num_inference_steps=steps, generator=generators, output_type="latent"
        )
        out.append(result.images)
    return torch.cat(out)


def _xt_rule(tol: float, patience: int) -> Any:
    """The naive rule: stop when x_t (the noisy sample) moved by less than ``tol`` for ``patience``
    steps in a row."""
    import stopcock

    changes: list[float] = []
    previous: list[torch.Tensor] = []

    def settled(state: Any) -> bool:
        latents = state.latents
        if latents is None:  # the check before the first step
            return False
        if previous:
            scale = float(previous[0].pow(2).mean().sqrt())
            changes.append(float((latents - previous[0]).pow(2).mean().sqrt()) / scale)
        previous[:] = [latents.clone()]
        return len(changes) >= patience and max(changes[-patience:]) < tol

    return stopcock.when(settled, reason="x_t settled")


def _one_by_one(pipe: Any, n: int, stop: Callable[[], Any], partial: str) -> tuple[torch.Tensor, list[int]]:
    import stopcock

    images, steps = [], []
    for i in range(n):
        outcome = stopcock.run(
            pipe,
            str(i % 10),
            num_inference_steps=FULL_STEPS,
            generator=torch.Generator().manual_seed(i),
            output_type="latent",
            stop=stop(),
            partial=partial,
        )
        images.append(outcome.output.images)
        steps.append(outcome.steps)
    return torch.cat(images), steps


def bench_converged(n: int) -> tuple[list[Table], dict[str, list[tuple[str, float, float, float]]]]:
    import stopcock
    from stopcock.loading import load_image_pipeline, resolve_model

    pipe = load_image_pipeline(resolve_model(None, "image"), quiet=True)
    clf, real_accuracy, real_diversity = _classifier()
    labels = np.arange(n) % 10
    rng = np.random.default_rng(0)
    table = Table(
        f"converged() on the demo digits model: {n} images a setting (digit i % 10, seed i), guidance 7.5;"
        " ± is half the bootstrap 95% interval over the images (diversity: see below)",
        [
            "scheduler",
            "setting",
            "steps used (mean)",
            "RMSE to the full run",
            "same-digit diversity",
            "classifier accuracy",
        ],
    )
    plot: dict[str, list[tuple[str, float, float, float]]] = {}
    for name, scheduler in _schedulers(pipe).items():
        pipe.scheduler = scheduler
        print(f"converged: {name}", file=sys.stderr, flush=True)
        full = _pixels(_batched(pipe, n, FULL_STEPS))
        rows: list[tuple[str, np.ndarray, float]] = [(f"full run ({FULL_STEPS} steps)", full, FULL_STEPS)]
        same_cost = []
        for tol in TOLERANCES:
            converging = functools.partial(stopcock.converged, tol, PATIENCE)
            latents, steps = _one_by_one(pipe, n, converging, "denoised")
            rows.append(
                (
                    f"converged(tol={tol:g}, patience={PATIENCE}), x0 kept",
                    _pixels(latents),
                    float(np.mean(steps)),
                )
            )
            same_cost.append(round(float(np.mean(steps))))
        for steps_n in sorted({*SCHEDULES, *same_cost}):
            what = " (same mean cost as converged)" if steps_n in same_cost else ""
            rows.append((f"{steps_n}-step schedule{what}", _pixels(_batched(pipe, n, steps_n)), steps_n))
        for tol in TOLERANCES:
            latents, steps = _one_by_one(pipe, n, functools.partial(_xt_rule, tol, PATIENCE), "raw")
            rows.append((f"naive x_t rule (tol={tol:g}), x_t kept", _pixels(latents), float(np.mean(steps))))
        plot[name] = []
        for label, images, used in rows:
            err = np.sqrt(((images - full) ** 2).mean(axis=1))
            hits = (clf.predict(images) == labels).astype(float)
            table.add(
                name,
                label,
                f"{used:.1f}",
                f"{err.mean():.3f} ± {_ci(err, np.mean, rng):.3f}",
                f"{_diversity(images, labels):.2f} ± {_ci_halves(images, labels, rng):.2f}",
                f"{hits.mean():.2f} ± {_ci(hits, np.mean, rng):.2f}",
            )
            plot[name].append((label, used, float(err.mean()), float(hits.mean())))
    table.add(
        "real digits", "scikit-learn's 1797", "", "", f"{real_diversity:.2f}", f"{real_accuracy:.2f} (5-fold)"
    )
    return [table], plot


def _plot(plot: dict[str, list[tuple[str, float, float, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(plot), figsize=(4.2 * len(plot), 3.6), sharey=True)
    for ax, (name, points) in zip(np.atleast_1d(axes), plot.items(), strict=True):
        schedules = sorted(
            (used, rmse) for label, used, rmse, _ in points if "schedule" in label or "full" in label
        )
        ax.plot(*zip(*schedules, strict=True), "o-", color="tab:blue", label="fixed schedule (n steps)")
        for label, used, rmse, _ in points:
            if label.startswith("converged"):
                ax.plot(used, rmse, "s", color="tab:orange", label="converged(), x0 kept")
                ax.annotate(
                    label.split(",")[0].removeprefix("converged(").replace("tol=", "tol "),
                    (used, rmse),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
            elif label.startswith("naive"):
                ax.plot(used, rmse, "x", color="tab:red", label="naive x_t rule")
        ax.set_title(name)
        ax.set_xlabel("denoising steps used (mean)")
        ax.grid(alpha=0.3)
    first = np.atleast_1d(axes)[0]
    first.set_ylabel("RMSE to the 50-step image")
    handles, names = first.get_legend_handles_labels()
    unique = dict(zip(names, handles, strict=True))
    first.legend(unique.values(), unique.keys(), fontsize=7)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)
    DOCS_PLOT.parent.mkdir(exist_ok=True)
    shutil.copyfile(PLOT, DOCS_PLOT)


# -- the report ------------------------------------------------------------------------------------
def _write(blocks: dict[str, str]) -> None:
    """Put ``blocks`` (by name) between this bench's markers in RESULTS.md, keeping the other's."""
    text = RESULTS.read_text()
    old: dict[str, str] = {}
    if START in text:
        before, rest = text.split(START, 1)
        inside, after = rest.split(END, 1)
        for name, body in re.findall(r"<!-- quality:(\w+) -->\n(.*?)<!-- /quality -->\n", inside, re.S):
            old[name] = body
        text = before.rstrip("\n") + "\n" + after
    old.update(blocks)
    parts = [
        f"<!-- quality:{name} -->\n{old[name]}<!-- /quality -->\n"
        for name in ("repetition", "converged")
        if name in old
    ]
    section = (
        f"\n{START}\n## 8. Stops that judge the output\n\nGenerated by `python -m bench.quality` (not by"
        " `python -m bench`; rerun it to update this section). One torch thread, CPU, float32.\n\n"
        + "\n".join(parts)
        + f"{END}\n"
    )
    RESULTS.write_text(text.rstrip("\n") + "\n" + section)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", metavar="PART", help="repetition, converged (default: both)")
    parser.add_argument("--n", type=int, default=200, help="images per converged setting (default 200)")
    parser.add_argument("--print", action="store_true", help="print the tables; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    parts = args.parts or ["repetition", "converged"]
    if set(parts) - {"repetition", "converged"}:
        parser.error(f"parts are repetition and converged, got {parts}")
    blocks = {}
    with quiet():
        torch.set_num_threads(1)
        if "repetition" in parts:
            start = time.perf_counter()
            tables = bench_repetition()
            blocks["repetition"] = "\n\n".join(t.markdown() for t in tables) + (
                f"\n\nRows that loop: {len(LOOP_PROMPTS)} prompts to each of {len(LOOP_SEEDS)} tiny random"
                " GPT-2s (seeds " + ", ".join(map(str, LOOP_SEEDS)) + "); rows that do not: the demo text"
                " model (a 2-layer GPT-2 trained on the Zen of Python) from the first two words of each of"
                " its lines. Measured in"
                f" {time.perf_counter() - start:.0f} s.\n\n"
            )
        if "converged" in parts:
            start = time.perf_counter()
            tables, plot = bench_converged(args.n)
            if not args.print:
                _plot(plot)
            blocks["converged"] = "\n\n".join(t.markdown() for t in tables) + (
                "\n\nRMSE and diversity on the 8x8 images in [0, 1]; diversity is the mean L2 distance"
                " between two images of the same digit, its ± from random halves of the images (scaled by"
                " 1/√2). The classifier is a logistic regression trained on scikit-learn's digits."
                f" Plot: `bench/converged.png`. Measured in {time.perf_counter() - start:.0f} s.\n\n"
            )
    if args.print:
        print("\n".join(blocks.values()))
    else:
        _write(blocks)


if __name__ == "__main__":
    main()
