"""1. Overhead: throughput of ``stopcock.run(..., stop=StopSignal())`` vs the plain call, same model.

A stop that is never requested should cost nothing: before a stop is possible a token of
transformers' own loop runs no code of stopcock's (the criterion joins generate's list only when
armed), a denoising step one flag read in the wrapped ``scheduler.step`` (plus the recording of
the loop model's output), and, in abort mode, a module call nothing (the in-forward checks are
armed only when a stop becomes possible). Each table runs five arms interleaved in balanced orders
(each arm in each position, and right after each other arm, equally often): the plain call, the
plain call again (the A/A arm: its ratio to the first is pure noise), the library's native way
to stop (a flag-reading ``StoppingCriteria``, a ``callback_on_step_end`` setting the interrupt
flag), and ``run`` in finish and abort mode. The rounds are taken in shares, each in a fresh
process (its own code and data layout, which can shift a ratio by more than the noise between
calls), and the 95% confidence intervals come from a bootstrap over the processes, then the rounds
in each. Shares are added until the A/A ratio's interval and those of ``run`` are narrower than
the target's margin (or a limit is reached: the table then says it did not resolve it). The direct
per-call timings, beside the libraries' own criterion and callback, are the stable figure.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch
from transformers import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList, pipeline

import stopcock
from stopcock.adapters.diffusers_loop import LoopModels
from stopcock.control import RunControl
from stopcock.hooks import Tripwire

from . import instructions
from .common import (
    CPU,
    RANDOM_WEIGHTS,
    Device,
    Section,
    Table,
    clocked,
    cluster_median_ci,
    frozen_heap,
    image_pipeline,
    interleaved,
    median,
    median_ci,
    prompt_ids,
    quantile,
    quiet,
    text_model,
    timed,
)

PLAIN, AA, NATIVE, FINISH, ABORT = (
    "plain call",
    "plain call again (A/A)",
    "native stop",
    "`run`, mode=finish",
    "`run`, mode=abort",
)


@dataclass(frozen=True)
class Rounds:
    """How a throughput table takes its rounds: in shares of ``per_process`` rounds, each in a fresh
    process (``fresh``; in this one for the smoke test), at least ``least`` and at most ``most``
    shares, and past ``least`` until the intervals resolve the margin or ``budget_s`` seconds have passed."""

    per_process: int
    least: int
    most: int
    budget_s: float
    fresh: bool = True


@dataclass(frozen=True)
class TextCase:
    shape: tuple[int, int, int]  # (n_layer, n_embd, n_head)
    new_tokens: int
    target: float  # the throughput ratio to reach
    pipeline: bool = False  # also a text-generation pipeline arm set (a fixed cost per call shows there)
    counted: int = 0  # rounds of instruction counts (0: none); a call runs about 200 times slower there


@dataclass(frozen=True)
class Config:
    text: tuple[TextCase, ...]
    image_steps: int
    image_target: float
    rounds: Rounds
    image_rounds: Rounds  # an image call is four times a text call: more time to resolve the same margin
    check_calls: int
    fixed_calls: int  # rounds of the fixed-cost timing of a text call (an image call: a fifth of them)
    image_counted: int = 0  # rounds of instruction counts of the image table (0: none)
    in_place_rounds: int = 2  # rounds of the in-place timing (the smallest text model and the image call)
    counted_checks: int = 0  # calls a batch of the direct per-call costs counted in instructions (0: none)


QUICK = Config(
    text=(TextCase((2, 64, 2), 8, 0.995, pipeline=True),),
    image_steps=3,
    image_target=0.995,
    rounds=Rounds(per_process=2, least=2, most=2, budget_s=0, fresh=False),
    image_rounds=Rounds(per_process=2, least=2, most=2, budget_s=0, fresh=False),
    check_calls=200,
    fixed_calls=5,
)
FULL = Config(
    text=(TextCase((2, 64, 2), 64, 0.995, pipeline=True, counted=10),
          TextCase((12, 384, 6), 16, 0.999, counted=10)),
    image_steps=20,
    image_target=0.995,
    # shares of whole balanced designs (10 orders for five arms), so each share is balanced on its own
    rounds=Rounds(per_process=60, least=6, most=40, budget_s=360),
    image_rounds=Rounds(per_process=30, least=6, most=60, budget_s=900),
    check_calls=20000,
    fixed_calls=1000,
    image_counted=4,
    counted_checks=1000,
    in_place_rounds=60,
)

#: Costs timed as what a variant adds to a base call (paired batches, median), not on their own.
DIFFERENCES = ("in_list", "module_unarmed", "module_armed", "native_step", "step", "torch_hook", "record")
Arms = dict[str, Callable[[], Any]]  # name -> one measured call (timed: its (wall, CPU) seconds)
Times = dict[str, list[tuple[float, float]]]  # name -> the (wall, CPU) seconds of its calls


class _Flag(StoppingCriteria):
    """transformers' documented way to stop from outside: a criterion reading a flag per token."""

    def __init__(self) -> None:
        self.flag = threading.Event()

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        rows = input_ids.shape[0]
        return torch.full((rows,), self.flag.is_set(), dtype=torch.bool, device=input_ids.device)


def criterion_waits(call: Callable[[], object]) -> bool:
    """Whether ``call()`` (a quiet run) left stopcock's criterion out of every check generate made of
    its criteria list: the per-token cost before a stop is then no code of stopcock's at all."""
    checks: list[bool] = []
    real = StoppingCriteriaList.__call__

    def spying(self: StoppingCriteriaList, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        checks.append(any(type(c).__module__.startswith("stopcock") for c in self))
        return real(self, input_ids, scores, **kwargs)

    StoppingCriteriaList.__call__ = spying  # type: ignore[method-assign]
    try:
        call()
    finally:
        StoppingCriteriaList.__call__ = real  # type: ignore[method-assign]
    return bool(checks) and not any(checks)


def _interrupt_callback() -> Callable[..., dict[str, Any]]:
    """diffusers' documented way: a ``callback_on_step_end`` that sets ``pipe._interrupt`` once asked."""
    flag = threading.Event()

    def on_step_end(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        if flag.is_set():
            pipe._interrupt = True
        return tensors

    return on_step_end


def _arms(plain: Callable[..., Any], target: Any, args: tuple[Any, ...], kwargs: Callable[[], dict[str, Any]],
          native: Callable[[], dict[str, Any]], measure: Callable[[Callable[[], object]], Any]) -> Arms:
    """The five arms of a table, each ``measure``-ing one call; ``kwargs`` and ``native`` (the native
    stop's own arguments) are called afresh for every call (e.g. a new seeded generator)."""

    def with_stopcock(mode: str) -> Any:
        signal = stopcock.StopSignal()
        return measure(lambda: stopcock.run(target, *args, stop=signal, mode=mode, **kwargs()))

    return {
        PLAIN: lambda: measure(lambda: plain(*args, **kwargs())),
        AA: lambda: measure(lambda: plain(*args, **kwargs())),
        NATIVE: lambda: measure(lambda: plain(*args, **kwargs(), **native())),
        FINISH: lambda: with_stopcock("finish"),
        ABORT: lambda: with_stopcock("abort"),
    }


@dataclass(frozen=True)
class Throughput:
    """A throughput table, described by value so that a fresh process can build its arms:
    ``model.generate`` or a text-generation pipeline on a GPT-2 of ``shape`` (layers, width, heads)
    for ``steps`` new tokens, or the tiny SD pipeline for ``steps`` denoising steps."""

    kind: Literal["generate", "pipeline", "image"]
    steps: int
    shape: tuple[int, int, int] = (2, 64, 2)

    @property
    def label(self) -> str:
        if self.kind == "image":
            return "tiny SD 64x64, DDIM"
        model = f"GPT-2 {self.shape[0]}x{self.shape[1]}"
        return model + (", text-generation pipeline" if self.kind == "pipeline" else "")


def _image_arms(sd: Any, steps: int, measure: Callable[[Callable[[], object]], Any]) -> Arms:
    """The five arms of an image table on the pipeline ``sd``, ``steps`` denoising steps a call."""

    def denoise() -> dict[str, Any]:
        return {"num_inference_steps": steps, "generator": torch.Generator().manual_seed(0)}

    return _arms(sd, sd, ("a red fox",), denoise, lambda: {"callback_on_step_end": _interrupt_callback()},
                 measure)


def build_arms(table: Throughput, device: Device,
               measure: Callable[[Callable[[], object]], Any] | None = None) -> Arms:
    """The five arms of ``table``, on models built (or cached) in this process; each arm returns
    ``measure(call)`` (default: its wall-clock and CPU seconds, :func:`clocked`)."""
    measure = measure or (lambda call: clocked(call, device))
    if table.kind == "image":
        return _image_arms(image_pipeline(device=device), table.steps, measure)
    model, tokenizer = text_model(*table.shape, device=device)
    ids = prompt_ids(tokenizer, 16, device)

    def generate() -> dict[str, Any]:
        return {"max_new_tokens": table.steps, "min_new_tokens": table.steps, "do_sample": False}

    def native() -> dict[str, Any]:
        return {"stopping_criteria": StoppingCriteriaList([_Flag()])}

    if table.kind == "pipeline":
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, device=model.device)
        return _arms(pipe, pipe, (tokenizer.decode(ids[0]),), generate, native, measure)
    return _arms(model.generate, model, (ids,), generate, native, measure)


def timed_share(table: Throughput, device: Device, rounds: int) -> Times:
    """One process's share of a table: its arms built here, two warm-up rounds (a new process's
    first calls fill its caches), then ``rounds`` interleaved rounds with the heap frozen."""
    with quiet():
        arms = build_arms(table, device)
        interleaved(arms, 0, warmup=2)
        with frozen_heap():
            return interleaved(arms, rounds, warmup=0)


def in_fresh_process(table: Throughput, device: Device, rounds: int) -> Times:
    """:func:`timed_share` in a new Python process (spawned: it inherits the environment, no memory), so
    each share runs with a code and data layout of its own."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(timed_share, table, device, rounds).result()


def _ratios(times: Times, arm: str, *, cpu: bool) -> list[float]:
    """Per round: the arm's throughput over the plain call's (its time divided into the plain's)."""
    k = 1 if cpu else 0
    return [p[k] / a[k] for p, a in zip(times[PLAIN], times[arm], strict=True)]


def _ci(shares: list[Times], arm: str, *, cpu: bool = True) -> tuple[float, float]:
    return cluster_median_ci([_ratios(times, arm, cpu=cpu) for times in shares])


def _measure(table: Throughput, device: Device, target: float, rounds: Rounds) -> tuple[list[Times], float]:
    """Shares of rounds until the CPU-time ratios' 95% CIs (the A/A arm's and ``run``'s) are
    narrower than ``1 - target`` (at least ``rounds.least``, at most ``rounds.most`` shares or
    ``rounds.budget_s`` seconds); each share's times, and the seconds they took."""
    take = in_fresh_process if rounds.fresh else timed_share
    shares: list[Times] = []
    started = time.monotonic()
    while True:
        shares.append(take(table, device, rounds.per_process))
        took = time.monotonic() - started
        widest = max(hi - lo for lo, hi in (_ci(shares, arm) for arm in (AA, FINISH, ABORT)))
        enough = widest <= 1 - target or took > rounds.budget_s
        if len(shares) >= rounds.most or (len(shares) >= rounds.least and enough):
            return shares, took


def _fastest(times: list[tuple[float, float]]) -> float:
    """The 10th percentile of the CPU times."""
    return quantile([cpu for _, cpu in times], 0.1)


@dataclass
class Resolution:
    """How well a table resolved its target: its rounds, the processes they ran in, the seconds they
    took, and the widths of the CPU-time ratios' 95% CIs (the A/A arm's, and the wider of ``run``'s)."""

    target: float
    rounds: int
    processes: int
    seconds: float
    aa_width: float
    run_width: float

    @property
    def width(self) -> float:
        return max(self.aa_width, self.run_width)

    @property
    def resolved(self) -> bool:
        return self.width <= 1 - self.target

    @property
    def needed(self) -> float:
        """How many times these processes the margin needs at this noise (a CI narrows as 1/sqrt(n))."""
        return (self.width / (1 - self.target)) ** 2


def compare(table: Table, spec: Throughput, device: Device, target: float, rounds: Rounds
            ) -> tuple[dict[str, Any], Resolution]:
    """Time ``spec``'s arms, add one row per arm; the numbers per arm, and the table's resolution."""
    shares, took = _measure(spec, device, target, rounds)
    pooled: Times = {name: [v for times in shares for v in times[name]] for name in shares[0]}
    out: dict[str, Any] = {}
    for name, values in pooled.items():
        wall, cpu = _ratios(pooled, name, cpu=False), _ratios(pooled, name, cpu=True)
        per_process = [median(_ratios(times, name, cpu=True)) for times in shares]
        found = {
            "ratio": median(wall), "ci": _ci(shares, name, cpu=False),
            "cpu_ratio": median(cpu), "cpu_ci": _ci(shares, name),
            "per_process": (min(per_process), max(per_process)),
            "seconds": median([v[0] for v in values]),
            # noise from other processes only adds time: the fastest calls of each arm are the least disturbed
            "fast_cpu_ratio": _fastest(pooled[PLAIN]) / _fastest(values),
        }
        out[name] = found
        table.add(
            spec.label, name, f"{spec.steps / found['seconds']:.1f}",
            f"{found['ratio']:.4f} [{found['ci'][0]:.4f}, {found['ci'][1]:.4f}]",
            f"{found['cpu_ratio']:.4f} [{found['cpu_ci'][0]:.4f}, {found['cpu_ci'][1]:.4f}]",
            f"{quantile(cpu, 0.25):.3f} to {quantile(cpu, 0.75):.3f}",
            f"{found['per_process'][0]:.4f} to {found['per_process'][1]:.4f}",
            f"{found['fast_cpu_ratio']:.4f}",
        )

    def width(arm: str) -> float:
        lo, hi = out[arm]["cpu_ci"]
        return float(hi - lo)

    resolution = Resolution(target, len(pooled[PLAIN]), len(shares), took, width(AA),
                            max(width(FINISH), width(ABORT)))
    return out, resolution


# -- the instruction counts ---------------------------------------------------------------------------------
def _paired(plain: list[int], values: list[int]) -> dict[str, Any]:
    """The plain call's count over an arm's in the same round (median, 95% CI, middle half), and what
    the arm adds (median difference in the same round)."""
    ratios = [p / a for p, a in zip(plain, values, strict=True)]
    return {"ratio": median(ratios), "ci": median_ci(ratios),
            "middle": (quantile(ratios, 0.25), quantile(ratios, 0.75)),
            "added": median([a - p for p, a in zip(plain, values, strict=True)])}


def counted_rows(table: Table, spec: Throughput, counted: instructions.Counted) -> dict[str, Any]:
    """One row per arm of ``spec``'s instruction counts (see :mod:`bench.instructions`): the median
    count, :func:`_paired` on the whole counts, and again on the counts less their instructions in the
    memory allocators (``"lean"``), whose paths vary with the heap's state more than with the call."""
    out: dict[str, Any] = {}
    counts = counted.counts
    lean = {name: [n - a for n, a in zip(values, counted.allocators[name], strict=True)]
            for name, values in counts.items()}
    for name, values in counts.items():
        found = {**_paired(counts[PLAIN], values), "instructions": median(values),
                 "lean": _paired(lean[PLAIN], lean[name])}
        out[name] = found
        slim = found["lean"]
        table.add(
            spec.label, name, f"{found['instructions'] / 1e6:,.2f}",
            f"{found['ratio']:.5f} [{found['ci'][0]:.5f}, {found['ci'][1]:.5f}]",
            f"{found['middle'][0]:.5f} to {found['middle'][1]:.5f}",
            "" if name == PLAIN else f"{found['added'] / 1e3:+,.0f}",
            f"{slim['ratio']:.5f} [{slim['ci'][0]:.5f}, {slim['ci'][1]:.5f}]",
            "" if name == PLAIN else f"{slim['added'] / 1e3:+,.0f}",
        )
    return out


def count_instructions(table: Table, config: Config, device: Device) -> dict[str, Any]:
    """The tables of ``config`` that ask for it, counted (on the CPU, two at once): per table, its
    rows' numbers, target, rounds and seconds; ``{"missing": why}`` where they cannot be counted."""
    jobs = [(Throughput(kind, case.new_tokens, case.shape), case.target, case.counted)
            for case in config.text if case.counted
            for kind in ("generate", *(("pipeline",) if case.pipeline else ()))]
    if config.image_counted:
        jobs.append((Throughput("image", config.image_steps), config.image_target, config.image_counted))
    if not jobs:
        return {}
    if device != CPU:
        return {"missing": f"instructions are counted on the CPU in float32 only, not on {device.describe()}"}
    why = instructions.missing()
    if why:
        return {"missing": f"instructions not counted: it {why}"}
    jobs.sort(key=lambda job: (job[0].kind != "image", -job[0].shape[0]))  # the longest first
    out: dict[str, Any] = {}
    for (spec, target, rounds), (counted, seconds) in zip(
        jobs, instructions.count_tables([(spec, rounds) for spec, _, rounds in jobs]), strict=True
    ):
        out[spec.label] = {"arms": counted_rows(table, spec, counted), "target": target,
                           "rounds": rounds, "seconds": seconds, "avx2_share": counted.avx2_share}
    return out


# -- the direct per-call costs ------------------------------------------------------------------------
class Measure(Protocol):
    """How the direct per-call costs are measured: in seconds (:class:`Timed`) or in instructions
    (:class:`bench.instructions.Counting`, under callgrind)."""

    unit: str

    def per_call(self, fn: Callable[[], object], calls: int) -> float:
        """What one call of ``fn`` costs."""
        ...

    def added(self, base: Callable[[], object], variant: Callable[[], object], calls: int,
              within: Callable[[], Any] = contextlib.nullcontext) -> float:
        """What ``variant`` (run ``within`` a context) costs per call beyond ``base``."""
        ...


@dataclass(frozen=True)
class Timed:
    """Seconds per call on ``device``: the best of 5 batches (noise only ever adds time); what a
    variant adds, as the median over 31 pairs of batches timed one right after the other, in
    alternating order, so drift cancels."""

    device: Device = CPU
    unit: str = "s"

    def per_call(self, fn: Callable[[], object], calls: int) -> float:
        return min(timed(lambda: [fn() for _ in range(calls)], self.device) for _ in range(5)) / calls

    def added(self, base: Callable[[], object], variant: Callable[[], object], calls: int,
              within: Callable[[], Any] = contextlib.nullcontext) -> float:
        def batch(fn: Callable[[], object], context: Callable[[], Any]) -> float:
            with context():
                return timed(lambda: [fn() for _ in range(calls)], self.device)

        diffs = []
        for r in range(31):
            if r % 2:
                base_s, variant_s = batch(base, contextlib.nullcontext), batch(variant, within)
            else:
                variant_s, base_s = batch(variant, within), batch(base, contextlib.nullcontext)
            diffs.append(variant_s - base_s)
        return median(diffs) / calls


def check_costs(calls: int, measure: Measure, device: Device = CPU) -> dict[str, float]:
    """What a run adds per token, per module call and per denoising step, beside what the
    libraries' own mechanisms cost, each measured in isolation (``calls`` calls a batch)."""
    ids = torch.zeros((1, 32), dtype=torch.long, device=device.name)
    max_length = MaxLengthCriteria(max_length=10**9)
    ours = stopcock.stopping_criteria(stopcock.StopSignal())[0]  # the criterion class a run adds
    full = stopcock.stopping_criteria(stopcock.when(lambda state: False))[0]  # a check at every token
    costs: dict[str, float] = {
        "max_length": measure.per_call(lambda: max_length(ids, None), calls),
        "criterion": measure.per_call(lambda: ours(ids, None), calls),
        "criterion_full": measure.per_call(lambda: full(ids, None), calls),
    }
    alone, both = StoppingCriteriaList([max_length]), StoppingCriteriaList([max_length, ours])
    costs["in_list"] = measure.added(lambda: alone(ids, None), lambda: both(ids, None), calls)
    block = device.place(torch.nn.Linear(8, 8))
    x = torch.zeros(1, 8, device=device.name, dtype=device.torch_dtype)

    def call() -> Any:
        return block(x)

    @contextlib.contextmanager
    def unarmed() -> Iterator[None]:  # abort mode before any stop is possible
        with RunControl(stopcock.StopSignal(), mode="abort") as control, control.intercept():
            yield

    @contextlib.contextmanager
    def armed() -> Iterator[None]:  # a timeout not yet expired: the last ARM_AHEAD seconds before it
        with RunControl(stopcock.timeout(3600), mode="abort") as control:
            with Tripwire(None, lambda _m: control.poll()) as wire:
                wire.arm()
                yield

    with torch.no_grad():
        costs["module_unarmed"] = measure.added(call, lambda: block(x), calls, unarmed)
        costs["module_armed"] = measure.added(call, lambda: block(x), calls, armed)
    costs.update(_step_costs(calls // 10, measure, device))
    costs["block_hook"] = costs["module_unarmed"]  # what abort mode adds per block before a stop
    return costs


def check_rows(table: Table, costs: dict[str, float], unit: str) -> None:
    """One row per cost of :func:`check_costs`, in µs (``unit`` "s") or instructions per call."""
    rows = [
        ("`MaxLengthCriteria.__call__` (transformers' own, the anchor)", "max_length",
         "every token, every generate call"),
        ("stopcock's criterion `__call__`, nothing can fire (finish and abort)", "criterion",
         "every token, where the criterion is in the loop from the start (stop strings, max_steps, beam"
         " search, a generate of the model's own); with transformers' own greedy or sampling loop it is"
         " not called before a stop (the throughput tables' case)"),
        ("stopcock's criterion `__call__`, full check (`when()` sees every step)", "criterion_full",
         "every token, only when a condition must see each step"),
        ("stopcock's criterion in generate's `StoppingCriteriaList` (its call and the list's OR)",
         "in_list", "every token, where it is in the loop from the start (as above)"),
        ("a module call in abort mode before any stop is possible (nothing installed)", "module_unarmed",
         "each module call of each forward, abort"),
        ("a module call once armed (a stop is possible)", "module_armed",
         "each module call (of any thread), from a stop request (or the last 50 ms before a timeout)"
         " to the abort"),
        ("diffusers' `callback_on_step_end` as the pipeline runs it, reading a flag (the anchor)",
         "native_step", "every denoising step, native interrupt"),
        ("stopcock's wrapped `scheduler.step`, nothing can fire (finish and abort)", "step",
         "every denoising step"),
        ("a torch forward hook that does nothing (the anchor for any model hook: torch's dispatch)",
         "torch_hook", "each call of the hooked module"),
        ("stopcock's recording of a loop model's output (a wrapper of its call for the run's thread: after"
         " a finish-mode stop the loop is fast-forwarded from it)", "record",
         "each loop model call (the tiny SD's UNet: once per step), finish and abort"),
    ]
    alone = "best of 5" if unit == "s" else "count"
    for what, key, paid in rows:
        value = f"{costs[key] * 1e6:.2f}" if unit == "s" else f"{costs[key]:,.0f}"
        table.add(what, value, "difference" if key in DIFFERENCES else alone, paid)


def _step_costs(calls: int, measure: Measure, device: Device) -> dict[str, float]:
    """Per denoising step, each added to a real ``scheduler.step`` (DDIM on the tiny SD latents), so
    both run in the same state of the caches: stopcock's wrapped step, and what diffusers itself runs
    per step for a ``callback_on_step_end``. Per loop model call: stopcock's recording, beside a
    torch forward hook that does nothing (timed on a small module, where their cost shows)."""
    pipe = image_pipeline(device=device)
    scheduler = pipe.scheduler
    scheduler.set_timesteps(20)
    g = torch.Generator().manual_seed(0)
    latents, noise = (torch.randn(1, 4, 8, 8, generator=g).to(device.name, device.torch_dtype) for _ in "ab")
    t = scheduler.timesteps[5]

    def attached() -> Any:
        return stopcock.attach(pipe, stopcock.StopSignal())

    def step() -> Any:
        return scheduler.step(noise, t, latents)

    callback, inputs = _interrupt_callback(), ["latents"]

    def native_step(i: int = 5) -> Any:  # the lines of StableDiffusionPipeline.__call__'s loop
        result = step()
        callback_kwargs = {}
        for k in inputs:
            callback_kwargs[k] = {"latents": latents}[k]
        outputs = callback(pipe, i, t, callback_kwargs)
        return result, outputs.pop("latents", latents)

    costs = {"step": measure.added(step, step, calls, attached),
             "native_step": measure.added(step, native_step, calls)}
    block = device.place(torch.nn.Linear(8, 8))
    x = torch.zeros(1, 8, device=device.name, dtype=device.torch_dtype)

    @contextlib.contextmanager
    def torch_hook() -> Iterator[None]:
        handle = block.register_forward_hook(lambda _module, _args, _output: None)
        try:
            yield
        finally:
            handle.remove()

    with torch.no_grad():
        costs["torch_hook"] = measure.added(lambda: block(x), lambda: block(x), calls, torch_hook)
        recording = LoopModels([block]).recording
        costs["record"] = measure.added(lambda: block(x), lambda: block(x), calls, recording)
    return costs


# -- the fixed cost of a call of run() ------------------------------------------------------------------
def outside_forwards(call: Callable[[], object]) -> float:
    """Host seconds of ``call()`` outside its model forwards: before the first module call starts
    and after the last one returns (setting up, routing arguments, reading the result)."""
    marks: list[float] = []

    def first(_module: torch.nn.Module, _args: Any) -> None:
        if not marks:
            marks.append(time.perf_counter())

    def last(_module: torch.nn.Module, _args: Any, _out: Any) -> None:
        marks[1:] = [time.perf_counter()]

    pre = torch.nn.modules.module.register_module_forward_pre_hook(first)
    post = torch.nn.modules.module.register_module_forward_hook(last)
    try:
        start = time.perf_counter()
        call()
        end = time.perf_counter()
    finally:
        pre.remove()
        post.remove()
    return (marks[0] - start) + (end - marks[1])


def fixed_costs(table: Table, what: str, plain: Callable[..., Any], args: tuple[Any, ...],
                kwargs: Callable[[], dict[str, Any]], calls: int, target: Any = None) -> dict[str, float]:
    """The plain call's own time outside its forwards (the anchor), and what ``run`` on ``target``
    (default ``plain``) adds to it in each mode: medians over ``calls`` rounds in balanced orders."""

    def with_run(mode: str) -> float:
        stop = stopcock.StopSignal()
        call = target or plain
        return outside_forwards(lambda: stopcock.run(call, *args, stop=stop, mode=mode, **kwargs()))

    with frozen_heap():
        times = interleaved({"plain": lambda: outside_forwards(lambda: plain(*args, **kwargs())),
                             "finish": lambda: with_run("finish"), "abort": lambda: with_run("abort")}, calls)
    found = {"plain": median(times["plain"])}
    for mode in ("finish", "abort"):
        found[mode] = median([t - p for p, t in zip(times["plain"], times[mode], strict=True)])
    table.add(f"{what}: the plain call's own work outside the model forwards (the anchor)",
              f"{found['plain'] * 1e6:.1f}", "median", "every call")
    for mode in ("finish", "abort"):
        table.add(f"{what}: what `run`, mode={mode}, adds outside the forwards (binding before the first,"
                  " the Outcome after the last)", f"{found[mode] * 1e6:.1f}", "difference", "every call")
    return found


#: How the in-place rows name what each arm adds to the plain call.
_IN_PLACE_ARMS = {
    AA: "the plain call again adds (A/A: the noise of this row)",
    NATIVE: "the native stop adds",
    FINISH: "`run`, mode=finish, adds",
    ABORT: "`run`, mode=abort, adds",
}


def in_place(table: Table, spec: Throughput, rounds: int, device: Device) -> dict[str, dict[str, float]]:
    """Seconds each arm adds, in place, to the plain call's host time around its loop model (the tiny
    SD's UNet, the GPT-2): ``"step"``, per gap between two of its calls (guidance, ``scheduler.step``,
    the next call's inputs; a token's logits processing and criteria), the gaps of a call summed over
    the ``steps - 1`` gaps; ``"fixed"``, before its first call and after its last (setting up, the
    text encoder and VAE, the Outcome), once a call. Medians over ``rounds`` rounds of the five arms,
    less the plain call's figure in the same round (the plain call's row is its own figure). Unlike the
    direct timings (the same calls back to back, their code and data in the caches), this pays for what
    the forward in between evicted: each check after a model call runs cold."""
    sd = image_pipeline(device=device) if spec.kind == "image" else None
    model: torch.nn.Module = sd.unet if sd is not None else text_model(*spec.shape, device=device)[0]
    inner = model.forward
    marks: list[float] = []

    def forward(*args: Any, **kwargs: Any) -> Any:  # the same in every arm: run's binding calls it too
        device.sync()
        marks.append(time.perf_counter())
        try:
            return inner(*args, **kwargs)
        finally:
            device.sync()
            marks.append(time.perf_counter())

    def around(call: Callable[[], object]) -> tuple[float, float]:
        marks.clear()
        start = time.perf_counter()
        call()
        device.sync()
        end = time.perf_counter()
        ends, starts = marks[1:-1:2], marks[2::2]
        if len(starts) != spec.steps - 1:
            raise RuntimeError(f"the loop model was called {len(marks) // 2} times in {spec.steps} steps")
        return sum(s - e for e, s in zip(ends, starts, strict=True)), (marks[0] - start) + (end - marks[-1])

    arms = _image_arms(sd, spec.steps, around) if sd is not None else build_arms(spec, device, around)
    model.forward = forward  # type: ignore[method-assign]
    try:
        with frozen_heap():
            times = interleaved(arms, rounds, warmup=2)
    finally:
        del model.forward
    unit = "denoising step" if spec.kind == "image" else "token"
    gaps = spec.steps - 1
    plain = times[PLAIN]
    found = {"step": {PLAIN: median([g for g, _ in plain]) / gaps},
             "fixed": {PLAIN: median([f for _, f in plain])}}
    for arm in _IN_PLACE_ARMS:
        found["step"][arm] = median([(a[0] - p[0]) / gaps for p, a in zip(plain, times[arm], strict=True)])
        found["fixed"][arm] = median([a[1] - p[1] for p, a in zip(plain, times[arm], strict=True)])
    what = f"{spec.label}, {spec.steps} {unit}s"
    for key, where, paid in (("step", "between two model calls", f"every {unit}"),
                             ("fixed", "before the model's first call and after its last", "every call")):
        table.add(f"{what}: the plain call's own work {where}, in place (the anchor)",
                  f"{found[key][PLAIN] * 1e6:.1f}", "median", paid)
        for arm, text in _IN_PLACE_ARMS.items():
            table.add(f"{what}: what {text} {where}, in place", f"{found[key][arm] * 1e6:.1f}", "difference",
                      paid)
    return found


# -- host-device synchronisations (CUDA) ----------------------------------------------------------------
def count_syncs(fn: Callable[[], object]) -> int:
    """How many synchronising CUDA operations ``fn()`` makes (torch's sync debug mode)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def sync_rows(table: Table, label: str, steps: int, arms: Callable[[int], Arms]) -> dict[str, Any]:
    """Syncs per call of each arm at ``steps`` and ``2 * steps`` steps; what stopcock adds per step
    is the growth of its excess over the plain call (a per-call constant cancels)."""
    short, long = arms(steps), arms(2 * steps)
    counts = {name: (count_syncs(short[name]), count_syncs(long[name])) for name in short if name != AA}
    plain = counts[PLAIN]
    out: dict[str, Any] = {}
    for name, (a, b) in counts.items():
        per_step = ((b - plain[1]) - (a - plain[0])) / steps
        out[name] = {"syncs": a, "per_step": per_step}
        table.add(label, name, a, b, "" if name == PLAIN else f"{per_step:+.2f}")
    return out


# -- the benchmark -----------------------------------------------------------------------------------------
def run(quick: bool = False, device: Device = CPU) -> Section:
    config = QUICK if quick else FULL
    columns = ["model", "call", "{unit}/s (median)", "throughput ratio to plain, wall [95% CI]",
               "CPU-time ratio [95% CI]", "middle half of the rounds (CPU)",
               "per-process medians (CPU), lowest to highest", "CPU-time ratio of the fastest tenth"]
    text = Table("Text generation: tokens/s, greedy, batch 1", [c.format(unit="tokens") for c in columns])
    image = Table("Denoising: steps/s of the whole call", [c.format(unit="steps") for c in columns])
    checks = Table("Cost of one call, timed directly", ["what", "µs per call", "timed as", "paid"])
    syncs = Table(
        "Host-device synchronisations (CUDA sync debug mode): per call at n and 2n steps",
        ["model", "call", "syncs, n steps", "syncs, 2n steps", "added by stopcock per step"],
    )
    data: dict[str, Any] = {
        "text": {}, "image": {}, "implied": {}, "syncs": {}, "resolution": {}, "fixed": {},
    }
    timer = Timed(device)
    costs = data["costs"] = check_costs(config.check_calls, timer, device)
    check_rows(checks, costs, timer.unit)
    data["checks"] = {key: costs[key] for key in ("step", "criterion", "block_hook")}
    implied = Table(
        "Overhead per call implied by the direct timings (generate)",
        ["model", "tokens", "plain ms per token", "stopcock per token, before a stop (finish and abort)",
         "`run` per call outside the forwards (finish / abort)", "share per token",
         "share in all (finish / abort)"],
    )
    first = config.text[0]  # the smallest model: nothing in a run's fixed cost depends on the model's size
    model, tokenizer = text_model(*first.shape, device=device)
    ids = prompt_ids(tokenizer, 16, device)
    two: dict[str, Any] = {"max_new_tokens": 2, "min_new_tokens": 2, "do_sample": False}
    name = f"GPT-2 {first.shape[0]}x{first.shape[1]}, 2 new tokens"
    fixed = data["fixed"]["generate"] = fixed_costs(
        checks, f"`model.generate` ({name})", model.generate, (ids,), lambda: two, config.fixed_calls, model
    )
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, device=model.device)
    data["fixed"]["pipeline"] = fixed_costs(
        checks, f"text-generation pipeline ({name})", pipe, (tokenizer.decode(ids[0]),), lambda: two,
        config.fixed_calls,
    )
    for case in config.text:
        model, tokenizer = text_model(*case.shape, device=device)
        ids = prompt_ids(tokenizer, 16, device)
        spec = Throughput("generate", case.new_tokens, case.shape)
        label = spec.label
        data["text"][label], data["resolution"][label] = compare(
            text, spec, device, case.target, config.rounds
        )
        call_s = data["text"][label][PLAIN]["seconds"]
        per_token = call_s / case.new_tokens
        waits = criterion_waits(
            lambda model=model, ids=ids: stopcock.run(model, ids, stop=stopcock.StopSignal(), **two)
        )
        data.setdefault("waits", {})[label] = waits
        token_cost = 0.0 if waits else costs["in_list"]
        share = (token_cost + costs["module_unarmed"]) / per_token
        in_all = {m: share + fixed[m] / call_s for m in ("finish", "abort")}
        data["implied"][label] = {"per_token": share, **in_all}
        implied.add(
            label, case.new_tokens, f"{per_token * 1e3:.3f}",
            "none (no code of stopcock's runs)" if waits else f"{costs['in_list'] * 1e6:.2f} µs",
            f"{fixed['finish'] * 1e6:.0f} / {fixed['abort'] * 1e6:.0f} µs", f"{share:.3%}",
            f"{in_all['finish']:.3%} / {in_all['abort']:.3%}",
        )
        if device.cuda:
            data["syncs"][label] = sync_rows(
                syncs, label, 8, lambda n, spec=spec: build_arms(replace(spec, steps=n), device)
            )
        if case.pipeline:
            piped = Throughput("pipeline", case.new_tokens, case.shape)
            data["text"][piped.label], data["resolution"][piped.label] = compare(
                text, piped, device, case.target, config.rounds
            )

    spec = Throughput("image", config.image_steps)
    label = spec.label
    data["image"][label], data["resolution"][label] = compare(
        image, spec, device, config.image_target, config.image_rounds
    )
    sd = image_pipeline(device=device)
    data["fixed"]["image"] = fixed_costs(
        checks, f"{label} pipeline (2 steps)", sd, ("a red fox",),
        lambda: {"num_inference_steps": 2, "generator": torch.Generator().manual_seed(0)},
        max(2, config.fixed_calls // 5),
    )
    data["in_place"] = {
        where.label: in_place(checks, where, config.in_place_rounds, device)
        for where in (Throughput("generate", first.new_tokens, first.shape),
                      Throughput("pipeline", first.new_tokens, first.shape), spec)
    }
    if device.cuda:
        data["syncs"][label] = sync_rows(
            syncs, label, 4, lambda n: build_arms(replace(spec, steps=n), device)
        )
    counted = Table(
        "Work per call: instructions, counted under valgrind's callgrind",
        ["model", "call", "instructions (millions, median)", "instruction ratio to plain [95% CI]",
         "middle half of the rounds", "added to the plain call (thousands, median)",
         "ratio without the allocators [95% CI]", "added without the allocators (thousands)"],
    )
    data["counted"] = count_instructions(counted, config, device)
    counted_checks = Table("Cost of one call, counted in instructions (callgrind)",
                           ["what", "instructions per call", "counted as", "paid"])
    if config.counted_checks and "missing" not in data["counted"] and device == CPU:
        data["counted_costs"] = instructions.count_checks(config.counted_checks)
        check_rows(counted_checks, data["counted_costs"], "instructions")
    return Section(
        title="1. Overhead of a stop that is never requested",
        intro=(
            f"On {device.describe()}. Same model, same inputs; five arms interleaved after a warm-up, in"
            " balanced orders (each arm in each position, and right after each other arm, equally often):"
            " the plain call, the plain call again (A/A: its ratio to the first is the"
            " noise of the table), the library's native stop (transformers: a `StoppingCriteria` reading"
            " a flag; diffusers: a `callback_on_step_end` setting `_interrupt`), and `run` with a"
            " `StopSignal` that never fires, in finish and abort mode. Text: new tokens from a 16-token"
            f" prompt; images: {config.image_steps} steps, whole call (text encoding and VAE decode"
            " included). *Throughput ratio* is the plain call's time over the arm's in the same round"
            " (median; > 1 is faster), from wall-clock time and from the CPU time of the calling thread"
            " (with one torch thread it does all the work; it leaves out the time other processes held"
            " the core); the 95% confidence interval of the median is in brackets; the last column"
            " divides the arms' 10th-percentile CPU times (the calls other processes disturbed least)."
            f" The rounds are taken in shares of {config.rounds.per_process}"
            f" ({config.image_rounds.per_process} for the image table), "
            + ("each in a fresh Python process" if config.rounds.fresh else "all in this process (quick run)")
            + ": a process's code and data layout can shift a ratio by more than the noise between calls,"
            " which the A/A arm (the same code as the plain call) cannot see. So the intervals come from a"
            " bootstrap that resamples the processes, then the rounds within each, and a column gives the"
            " lowest and highest median of the processes. Shares are added until the A/A arm's interval"
            " and both of `run`'s are narrower than the target's margin (0.5%, or 0.1% for the 12-layer"
            f" model), between {config.rounds.least} and {config.rounds.most} processes and at most"
            f" {config.rounds.budget_s:g} s a text table ({config.image_rounds.least} to"
            f" {config.image_rounds.most}, {config.image_rounds.budget_s:g} s, the image table); read a"
            " ratio against its table's A/A row."
        ),
        tables=[text, image, *([counted] if counted.rows else []), checks,
                *([counted_checks] if counted_checks.rows else []), implied,
                *([syncs] if device.cuda else [])],
        notes=[
            *(_verdicts(data)),
            *(_counted_verdicts(data)),
            *([_COUNTED_NOTE.format(**_counted_config(config))] if data["counted"].get("missing") is None
              and data["counted"] else []),
            "The tiny models make a step as short as possible, so they show the worst case: a fixed"
            " cost per step is the largest fraction of it there.",
            "Per token before a stop: "
            + ("with transformers' own greedy loop, as here, stopcock's criterion is not in generate's"
               " criteria list until a stop becomes possible (checked on every model of the tables: no check"
               " of the list saw it during a quiet run), so a token runs no code of stopcock's; the"
               " criterion's per-call rows apply where it is in the loop from the start."
               if all(data.get("waits", {}).values()) else
               "stopcock's criterion was in generate's criteria list from the start on "
               + ", ".join(k for k, v in data.get("waits", {}).items() if not v) + "."),
            "Anchors: the native stop arms (the libraries' own ways to stop a run from outside) in the"
            " throughput tables; `MaxLengthCriteria` (transformers' own criterion, in every generate"
            " call) and diffusers' `callback_on_step_end` in the direct timings. Any criterion, the"
            " library's own included, also costs generate's `StoppingCriteriaList` one tensor OR per"
            " token, counted in the in-list figure.",
            "Direct timings: *best of 5* batches of calls, or, for what a run adds to a call (*difference*),"
            " the median over 31 pairs of batches with and without it, timed back to back in alternating"
            " order. Before a stop is possible abort mode installs nothing (its module-call figure times"
            " the same bare call twice, so it scatters around 0); once a stop is requested, every module"
            " call pays the armed cost until the abort, one module call later.",
            "Fixed cost per call: the host time of a call outside its model forwards (before the first"
            " module call starts, after the last one returns), timed with a global forward pre-hook and hook,"
            " for the plain call (what the library itself does there: the anchor) and for `run`, whose figure"
            f" is what it adds (median over {config.fixed_calls} rounds in balanced orders; an image call"
            " over a fifth of them). It is paid once per call, whatever its length: the implied-overhead"
            " table adds it to the per-token cost at the throughput tables' token counts.",
            "In place: the host time around the loop model's calls (the tiny SD's UNet, the GPT-2 of the"
            " smallest text table): between two of its calls (the loop's own work per step or token:"
            " guidance, `scheduler.step`, the next call's inputs; logits processing and criteria), summed"
            " over a call and divided by its steps less one, and before its first call and after its last"
            f" (once a call); medians over {config.in_place_rounds} rounds of the five arms in balanced"
            " orders; each arm's figure is what it adds to the plain call in the same round (the A/A row is"
            " the noise). The direct timings run the same calls back to back with their code and data in"
            " the caches; here each check runs after a forward has evicted them, as in a real call, so it"
            " costs more, for the native stop as for stopcock: these rows show where a throughput table's"
            " time goes.",
            "Host-device synchronisations are counted on CUDA only (`--device cuda`)." if not device.cuda
            else "A per-call constant (the row reasons read at the end of a run) cancels out of the"
            " per-step figure.",
            RANDOM_WEIGHTS,
        ],
        data=data,
        headline=_headline(data),
    )


def _verdicts(data: dict[str, Any]) -> list[str]:
    lines = []
    for kind in ("text", "image"):
        for label, arms in data[kind].items():
            r: Resolution = data["resolution"][label]
            modes = "; ".join(
                f"{a.split('=')[-1]} {arms[a]['ratio']:.4f} wall, {arms[a]['cpu_ratio']:.4f} CPU"
                f" [{arms[a]['cpu_ci'][0]:.4f}, {arms[a]['cpu_ci'][1]:.4f}]:"
                f" {'met' if min(arms[a]['ratio'], arms[a]['cpu_ratio']) >= r.target else 'below it'}"
                for a in (FINISH, ABORT)
            )
            widths = f"the A/A CI is {r.aa_width:.2%} wide, the wider of `run`'s {r.run_width:.2%}"
            resolution = (
                f"{widths}, within the {1 - r.target:.1%} margin"
                if r.resolved
                else f"{widths}, wider than the {1 - r.target:.1%} margin: the table cannot resolve the"
                f" target on this machine at this load (at this noise it would take about"
                f" {r.needed * r.processes:,.0f} processes, {r.needed * r.seconds / 3600:.1f} h)"
            )
            lines.append(
                f"{label}, target {r.target:g}: {modes}; {r.rounds} rounds in {r.processes} processes,"
                f" {resolution}."
            )
    return lines


_COUNTED_NOTE = (
    "Instructions (the callgrind table): a count of the instructions a call executes does not depend on"
    " the machine's load, so it resolves what time cannot here. Each table's arms are built as for"
    " timing, in one process run under `valgrind --tool=callgrind` (Python's hash seed fixed); after ten"
    " uncounted rounds of one-step calls (so that Python has specialised the bytecode of every function"
    " the arms call) and one warm-up round, they are called in {rounds} rounds in the same balanced"
    " orders; each call is preceded by an"
    " uncounted garbage collection (so the collections a call triggers are its own) and bracketed by"
    " callgrind's zero and dump requests. The ratio is the plain call's count over the arm's in the"
    " same round (median, 95% CI from order statistics); *added* is the median difference. What varies"
    " between rounds is mostly the allocators' paths (Python's and the C library's), which the A/A row"
    " measures: the same call's count moves with the heap's state (which free list a block comes from,"
    " when chunks are merged). The last two columns read each count less the instructions executed in"
    " the allocators' own functions (glibc's malloc, free, memalign and their internals; CPython's"
    " pymalloc), whose paths vary most: a narrower A/A interval, at the price of leaving out what the"
    " allocators do for the call itself. A count weighs every instruction alike: it leaves out cache"
    " misses, mispredicted branches and instruction widths. Under valgrind torch runs its AVX2 kernels"
    " (valgrind has no AVX-512, which torch takes natively on a CPU that has it), which execute more"
    " instructions for the same arithmetic: each verdict line gives the share of the plain call's count"
    " in AVX2 code (MKL's matrix kernels, torch's vector loops, the C library's), the part whose count a"
    " CPU with wider vectors would shrink. The time tables above measure the same calls in seconds, with"
    " their noise."
)


def _counted_config(config: Config) -> dict[str, str]:
    rounds = sorted({case.counted for case in config.text if case.counted} | {config.image_counted} - {0})
    return {"rounds": " or ".join(map(str, rounds))}


def _counted_verdict(label: str, found: dict[str, Any], measure: str | None = None) -> tuple[str, str]:
    """What a table's instruction counts say (``measure="lean"``: the counts less the allocators'):
    ``run``'s ratios with their 95% CIs against the target, and whether the A/A arm's CI and
    ``run``'s are narrow enough to resolve its margin."""
    arms = {arm: found["arms"][arm] for arm in (AA, FINISH, ABORT)}
    if measure:
        arms = {arm: figures[measure] for arm, figures in arms.items()}
    target = found["target"]

    def width(arm: str) -> float:
        lo, hi = arms[arm]["ci"]
        return float(hi - lo)

    def verdict(arm: str) -> str:
        ratio, (lo, _) = arms[arm]["ratio"], arms[arm]["ci"]
        if lo >= target:
            return "met (the whole CI)"
        return "met in the median, its CI reaches below" if ratio >= target else "below it"

    modes = "; ".join(
        f"{arm.split('=')[-1]} {arms[arm]['ratio']:.5f} [{arms[arm]['ci'][0]:.5f}, {arms[arm]['ci'][1]:.5f}]:"
        f" {verdict(arm)}" for arm in (FINISH, ABORT)
    )
    widest = max(width(AA), width(FINISH), width(ABORT))
    resolved = "resolved" if widest <= 1 - target else "not resolved"
    return modes, (
        f"A/A CI {width(AA):.3%} wide, `run`'s up to {max(width(FINISH), width(ABORT)):.3%}: {resolved} at"
        f" the {1 - target:.1%} margin"
    )


def _counted_verdicts(data: dict[str, Any]) -> list[str]:
    counted = data.get("counted", {})
    if "missing" in counted:
        return [f"Instructions not counted: {counted['missing']}."]
    lines = []
    for label, found in counted.items():
        modes, resolution = _counted_verdict(label, found)
        lean_modes, lean_resolution = _counted_verdict(label, found, "lean")
        lines.append(
            f"{label}, target {found['target']:g}, instructions: {modes}; {found['rounds']} rounds,"
            f" {resolution} ({found['seconds'] / 60:.0f} min under callgrind); {found['avx2_share']:.0%} of"
            f" the plain call's count is in AVX2 code. Without the allocators: {lean_modes};"
            f" {lean_resolution}."
        )
    return lines


def _headline(data: dict[str, Any]) -> list[str]:
    """One line per model: the throughput ratios of finish and abort mode, beside the A/A arm's."""
    lines = []
    for kind, unit in (("text", "tokens/s"), ("image", "steps/s")):
        for label, arms in data[kind].items():
            r: Resolution = data["resolution"][label]
            ratios = ", ".join(
                f"{arms[a]['ratio']:.4f} {a.split('=')[-1]} (CPU time {arms[a]['cpu_ratio']:.4f})"
                for a in (FINISH, ABORT)
            )
            lines.append(
                f"Overhead, {label}: {unit} of `run` / plain call = {ratios}; A/A {arms[AA]['cpu_ratio']:.4f}"
                f" (95% CI {r.aa_width:.2%} wide; `run`'s up to {r.run_width:.2%}), native stop"
                f" {arms[NATIVE]['cpu_ratio']:.4f};"
                f" target {r.target:g}."
            )
    for label, found in data.get("counted", {}).items():
        if label == "missing":
            continue
        arms = found["arms"]
        modes, resolution = _counted_verdict(label, found)
        lines.append(
            f"Work, {label}: instructions of the plain call / `run`'s, counted under callgrind: {modes};"
            f" A/A {arms[AA]['ratio']:.5f}, native stop {arms[NATIVE]['ratio']:.5f}; target"
            f" {found['target']:g}, {resolution}."
        )
    c = data["costs"]
    lines.append(
        f"Timed directly: stopcock's criterion {c['criterion'] * 1e6:.2f} µs per token against"
        f" {c['max_length'] * 1e6:.2f} µs for transformers' `MaxLengthCriteria`; the wrapped"
        f" `scheduler.step` {c['step'] * 1e6:.2f} µs per step against {c['native_step'] * 1e6:.2f} µs for"
        f" diffusers' `callback_on_step_end`, and the recording {c['record'] * 1e6:.2f} µs per loop"
        f" model call against {c['torch_hook'] * 1e6:.2f} µs for a torch hook that does nothing; abort mode"
        f" before a stop {c['module_unarmed'] * 1e6:.2f} µs"
        f" per module call (nothing installed), {c['module_armed'] * 1e6:.2f} µs once armed."
    )
    n = data.get("counted_costs")
    if n:
        lines.append(
            f"Counted in instructions (callgrind): stopcock's criterion {n['criterion']:,.0f} per token"
            f" against {n['max_length']:,.0f} for `MaxLengthCriteria`; the wrapped `scheduler.step`"
            f" {n['step']:,.0f} per step against {n['native_step']:,.0f} for diffusers'"
            f" `callback_on_step_end`; the recording {n['record']:,.0f} per loop model call against"
            f" {n['torch_hook']:,.0f} for a torch hook that does nothing; a module call in abort mode before"
            f" a stop {n['module_unarmed']:,.0f}, {n['module_armed']:,.0f} once armed."
        )
    f = data["fixed"]
    lines.append(
        "Fixed cost of a call of `run` itself (outside the model forwards, finish / abort), beside the plain"
        " call's own: " + "; ".join(
            f"{what} {f[key]['finish'] * 1e6:.0f} / {f[key]['abort'] * 1e6:.0f} µs against"
            f" {f[key]['plain'] * 1e6:.0f} µs"
            for key, what in (("generate", "`generate`"), ("pipeline", "text-generation pipeline"),
                              ("image", "tiny SD pipeline")) if key in f
        ) + "."
    )
    for label, g in data.get("in_place", {}).items():
        unit = "token" if label.startswith("GPT-2") else "step"
        step, fixed = g["step"], g["fixed"]
        lines.append(
            f"In place, {label} (each check runs just after a forward): `run` adds"
            f" {step[FINISH] * 1e6:.1f} / {step[ABORT] * 1e6:.1f} µs per {unit} (finish / abort), the"
            f" native stop {step[NATIVE] * 1e6:.1f} µs, the plain call again {step[AA] * 1e6:+.1f} µs"
            f" (noise), beside the {unit}'s own {step[PLAIN] * 1e6:.0f} µs; and {fixed[FINISH] * 1e6:.0f} /"
            f" {fixed[ABORT] * 1e6:.0f} µs a call before the model's first call and after its last."
        )
    for label, found in data["syncs"].items():
        added = ", ".join(f"{name.split('=')[-1]} {v['per_step']:+.2f}" for name, v in found.items()
                          if name in (FINISH, ABORT))
        lines.append(f"Host-device syncs added per step, {label}: {added}.")
    return lines
