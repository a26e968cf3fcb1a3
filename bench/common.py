"""What every benchmark shares: tables, interleaved timing, a stop from another thread at a chosen
moment, the models, and the machine description written at the top of RESULTS.md."""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from tiny.blocks import find_blocks

T = TypeVar("T")
RANDOM_WEIGHTS = "All models have random weights (built offline from configs; no model hub)."


# -- results ---------------------------------------------------------------------------------------
@dataclass
class Table:
    """A markdown table: ``rows`` hold already formatted cells."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        lines = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |"]
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass
class Section:
    """One benchmark's results: prose, tables, the raw numbers (for the smoke test), and the
    headline lines the README summary quotes."""

    title: str
    intro: str
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    headline: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        parts = [f"## {self.title}", self.intro]
        parts += [t.markdown() for t in self.tables]
        parts.append("\n".join(f"- {n}" for n in self.notes))
        return "\n\n".join(parts)


def median(values: list[float]) -> float:
    return statistics.median(values)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def machine_info() -> dict[str, str]:
    """The facts a reader needs to judge the numbers."""
    import diffusers
    import transformers

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return {
        "date (UTC)": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "CPU": cpu,
        "cores": str(os.cpu_count()),
        "torch threads": str(torch.get_num_threads()),
        "load average at start (1, 5, 15 min)": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "diffusers": diffusers.__version__,
        "platform": platform.platform(),
    }


# -- where the benchmarks run -------------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Device:
    """The torch device and dtype every model of a benchmark run is placed on (``--device``,
    ``--dtype``); on CUDA every timed section is bracketed by ``torch.cuda.synchronize()``."""

    name: str = "cpu"
    dtype: str = "float32"

    @classmethod
    def checked(cls, name: str, dtype: str) -> Device:
        """A usable device and dtype, or a ValueError naming the fix."""
        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
        if not name.startswith(("cpu", "cuda")):
            raise ValueError(f"--device takes cpu or cuda (cuda:N), got {name!r}")
        if name == "cpu" and dtype == "float16":
            raise ValueError("--dtype float16 needs --device cuda (CPU kernels lack it): use bfloat16")
        return cls(name, dtype)

    @property
    def cuda(self) -> bool:
        return self.name.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.name)

    def place(self, thing: T) -> T:
        """A model or pipeline moved to this device and dtype (in place for modules)."""
        return thing.to(self.name, self.torch_dtype)  # type: ignore[attr-defined, no-any-return]

    def describe(self) -> str:
        if not self.cuda:
            return f"CPU, {self.dtype}"
        return f"{torch.cuda.get_device_name(self.name)} ({self.name}), {self.dtype}"


CPU = Device()


# -- timing ----------------------------------------------------------------------------------------
def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` arms (a Williams design) in which each arm takes each position equally often
    and comes right after each other arm equally often: what ran just before a call (a cache warm
    from the same code, memory the last call freed) then favours no arm. ``n`` orders, ``2n`` for
    an odd ``n``. A plain rotation keeps the cyclic order, so each arm always follows the same one."""
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]  # 0, 1, n-1, 2, n-2...
    orders = [[(a + i) % n for a in first] for i in range(n)]
    return orders + [order[::-1] for order in orders] if n % 2 else orders


def interleaved(arms: dict[str, Callable[[], T]], reps: int, warmup: int = 1) -> dict[str, list[T]]:
    """Call each arm ``reps`` times (after ``warmup`` discarded calls), interleaved.

    Each round calls every arm once, in the next of the :func:`balanced_orders`, so slow drift
    (other processes, thermal state) and the call before each one hit every arm alike; each arm
    returns its own measurement.
    """
    names = list(arms)
    for _ in range(warmup):
        for name in names:
            arms[name]()
    orders = balanced_orders(len(names))
    results: dict[str, list[T]] = {name: [] for name in names}
    for r in range(reps):
        for i in orders[r % len(orders)]:
            results[names[i]].append(arms[names[i]]())
    return results


def timed(fn: Callable[[], object], device: Device = CPU) -> float:
    device.sync()
    start = time.perf_counter()
    fn()
    device.sync()
    return time.perf_counter() - start


def clocked(fn: Callable[[], object], device: Device = CPU) -> tuple[float, float]:
    """Wall-clock and CPU seconds of ``fn()`` on this thread (with one torch thread, all its work).

    CPU time leaves out the time other processes held the core, so it stays steady on a busy machine.
    """
    device.sync()
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    device.sync()
    return time.perf_counter() - wall, time.thread_time() - cpu


def median_ci(values: list[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval of the median (order statistics)."""
    ordered = sorted(values)
    n = len(ordered)
    half = 0.98 * math.sqrt(n)  # 1.96 * sqrt(n) / 2
    lo, hi = max(0, math.floor(n / 2 - half) - 1), min(n - 1, math.ceil(n / 2 + half) - 1)
    return ordered[lo], ordered[hi]


def cluster_median_ci(groups: list[list[float]], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% confidence interval of the median of values measured in equal groups (one group per
    process): a two-stage bootstrap that resamples the groups, then the values within each, so what
    differs between processes (code and data layout, the state of the machine) widens the interval
    as it should. One group: :func:`median_ci`."""
    if len(groups) == 1:
        return median_ci(groups[0])
    values = np.array(groups, dtype=float)  # (groups, values each): equal groups, or numpy refuses
    n, m = values.shape
    rng = np.random.default_rng(seed)
    chosen = rng.integers(0, n, (reps, n))
    within = rng.integers(0, m, (reps, n, m))
    medians = np.median(values[chosen[:, :, None], within].reshape(reps, -1), axis=1)
    lo, hi = np.quantile(medians, [0.025, 0.975])
    return float(lo), float(hi)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[round(q * (len(ordered) - 1))]


class Probe:
    """Forward pre-hooks that time a model's steps and hold it at a chosen moment for a stop.

    ``clock`` is the module called once per step (the decoder, the UNet): the start time of each
    call is recorded. On the ``at_call``-th call (0-based) of ``trigger`` (e.g. the middle block
    during the fifth step) the hook sets ``fired`` and waits until ``requested`` is set: the stop
    from the other thread lands exactly there, however the threads are scheduled. Installed before
    the run, so it sees each forward before stopcock's own hooks do.
    """

    def __init__(self, clock: nn.Module, trigger: nn.Module, at_call: int) -> None:
        self.clock, self.trigger, self.at_call = clock, trigger, at_call
        self.fired = threading.Event()
        self.requested = threading.Event()
        self.step_starts: list[float] = []
        self._calls = 0

    @contextmanager
    def installed(self) -> Iterator[Probe]:
        def on_clock(module: nn.Module, args: Any) -> None:
            self.step_starts.append(time.perf_counter())

        def on_trigger(module: nn.Module, args: Any) -> None:
            if self._calls == self.at_call:
                self.fired.set()
                if not self.requested.wait(timeout=60):
                    raise RuntimeError("the stopper thread did not answer within 60 s")
            self._calls += 1

        handles = [self.clock.register_forward_pre_hook(on_clock)]
        handles.append(self.trigger.register_forward_pre_hook(on_trigger))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def step_durations(self) -> list[float]:
        """Durations of the steps that were followed by another (start to next start)."""
        return [b - a for a, b in zip(self.step_starts, self.step_starts[1:], strict=False)]


@dataclass
class StopTiming:
    latency: float  # seconds from just before ``stop()`` on the other thread to the run's return
    result: Any
    probe: Probe
    stopped_at: float  # perf_counter just before ``stop()``

    def steps_started_after_stop(self) -> int:
        return sum(t > self.stopped_at for t in self.probe.step_starts)


def stop_from_thread(
    call: Callable[[], Any], stop: Callable[[], object], probe: Probe, device: Device = CPU
) -> StopTiming:
    """Run ``call()`` here; when ``probe`` fires, another thread calls ``stop()``.

    The latency runs from just before ``stop()`` to the return of ``call()`` (on CUDA, to the end
    of the work it queued). Raises if the run ended before the trigger fired (the configuration is
    then too short to measure anything).
    """
    stamp: list[float] = []
    done = threading.Event()

    def stopper() -> None:
        probe.fired.wait()
        if not done.is_set():
            stamp.append(time.perf_counter())
            stop()
        probe.requested.set()

    thread = threading.Thread(target=stopper, name="bench-stopper", daemon=True)
    with probe.installed():
        thread.start()
        try:
            result = call()
            device.sync()
            end = time.perf_counter()
        finally:
            done.set()
            probe.fired.set()  # releases the stopper when the run ended (or failed) first
            thread.join()
    if not stamp:
        raise RuntimeError("the run ended before the stop trigger fired: make the run longer")
    return StopTiming(latency=end - stamp[0], result=result, probe=probe, stopped_at=stamp[0])


# -- models ----------------------------------------------------------------------------------------
@cache
def text_model(n_layer: int = 2, n_embd: int = 64, n_head: int = 2, device: Device = CPU) -> tuple[Any, Any]:
    """A random-weight GPT-2 from :func:`tiny.text.build_text_model` and its tokenizer, on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny.text import build_text_model

    with tempfile.TemporaryDirectory(prefix="stopcock-bench-") as folder:
        build_text_model(folder, n_layer=n_layer, n_embd=n_embd, n_head=n_head)
        model = device.place(AutoModelForCausalLM.from_pretrained(folder).eval())
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def prompt_ids(tokenizer: Any, n_tokens: int, device: Device = CPU) -> torch.Tensor:
    """A deterministic prompt of exactly ``n_tokens`` tokens (batch of one), on ``device``."""
    text = "The quick brown fox jumps over the lazy dog. Stop the pipeline when asked. "
    ids = tokenizer(text * (1 + n_tokens // 8), return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise ValueError(f"prompt text too short for {n_tokens} tokens")
    return ids.to(device.name)


def image_pipeline(scheduler: str = "ddim", device: Device = CPU) -> Any:
    """The tiny Stable Diffusion pipeline of :mod:`tiny.image` with the named scheduler, on ``device``."""
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerDiscreteScheduler

    from tiny.image import stable_diffusion_pipeline

    pipe = stable_diffusion_pipeline()
    kinds = {"ddim": DDIMScheduler, "euler": EulerDiscreteScheduler, "dpm++": DPMSolverMultistepScheduler}
    if scheduler not in kinds:
        raise ValueError(f"scheduler must be one of {sorted(kinds)}, got {scheduler!r}")
    pipe.scheduler = kinds[scheduler].from_config(pipe.scheduler.config)
    return device.place(pipe)


def deep_flux_pipeline(double_blocks: int = 8, single_blocks: int = 16, device: Device = CPU) -> Any:
    """The tiny Flux pipeline of :mod:`tiny.image` with a deeper, wider transformer
    (random weights; 24 blocks and 128 channels by default): a DiT of realistic depth, CPU-sized."""
    from tiny.image import flux_pipeline

    pipe = flux_pipeline(num_layers=double_blocks, num_single_layers=single_blocks, num_attention_heads=8)
    return device.place(pipe)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks stopcock's abort mode hooks (see :func:`tiny.blocks.find_blocks`)."""
    found = find_blocks(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no blocks to hook")
    return found


def middle_block(model: nn.Module) -> str:
    """The qualified name of the middle one of ``model``'s blocks."""
    names = {id(m): name for name, m in model.named_modules()}
    found = blocks(model)
    return names[id(found[len(found) // 2])]


@contextmanager
def quiet() -> Iterator[None]:
    """No progress bars or advisory warnings in benchmark output, and one torch thread for steadier
    timings; everything is restored on exit (the smoke test runs inside a larger test session)."""
    import warnings

    import diffusers
    import transformers

    threads = torch.get_num_threads()
    levels = transformers.utils.logging.get_verbosity(), diffusers.utils.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        diffusers.utils.logging.set_verbosity_error()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            transformers.utils.logging.set_verbosity(levels[0])
            diffusers.utils.logging.set_verbosity(levels[1])
            if bars:
                transformers.utils.logging.enable_progress_bar()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The objects alive now (models, pipelines) moved out of the garbage collector's sight
    (``gc.freeze``), so a collection costs every timed call alike, whatever arm triggers it."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
