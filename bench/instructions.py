"""Instructions per call, counted by valgrind's callgrind: a measure of work that load cannot blur.

On a shared 2-core machine the time ratio of two calls moves by more than the 0.1 to 0.5% the
overhead targets must resolve, from one round to the next and from one process to the next. The
number of instructions a call executes does not depend on what else runs, on the clock or on the
host: the same code on the same inputs executes almost exactly the same instructions every time
(what does vary, the allocator's and the garbage collector's paths, the A/A arm measures). So each
throughput table is also counted: its arms built as for timing, in one process run under
``valgrind --tool=callgrind``, interleaved in the same balanced orders, each call after an uncounted
garbage collection and bracketed by a zeroing and a dump of callgrind's counters (valgrind's client
requests, from a few lines of C compiled here against valgrind's own header).

What a count leaves out is what an instruction costs: waiting on memory, mispredicted branches,
the clock. The time tables measure those, with their noise; the two measures are read together.
Needs ``valgrind`` (with its header ``valgrind/callgrind.h``) and a C compiler: on Debian
``apt-get install valgrind gcc`` (``make bench`` installs valgrind when run as root).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .overhead import Throughput

REQUESTS_C = """
#include <valgrind/callgrind.h>
int on_valgrind(void) { return RUNNING_ON_VALGRIND; }
void start_instrumentation(void) { CALLGRIND_START_INSTRUMENTATION; }
void zero_stats(void) { CALLGRIND_ZERO_STATS; }
void dump_stats(void) { CALLGRIND_DUMP_STATS; }
"""
HEADER = Path("/usr/include/valgrind/callgrind.h")
QUICKENED = 10  # rounds of one-step calls before counting (CPython specialises a function after 8 calls)
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Counted:
    """A table's counts: per arm, the instructions of each of its calls, and those of them in the
    memory allocators (see :func:`in_allocators`); and the share of the plain call's instructions
    executed in AVX2 code (see :func:`avx2_share`)."""

    counts: dict[str, list[int]]
    allocators: dict[str, list[int]]
    avx2_share: float


def missing() -> str | None:
    """Why instructions cannot be counted here (what to install), or None when they can."""
    needs = [name for name in ("valgrind", "cc") if shutil.which(name) is None]
    if not HEADER.exists():
        needs.append(str(HEADER))
    if not needs:
        return None
    return f"needs {', '.join(needs)} (Debian: apt-get install valgrind gcc)"


class Callgrind:
    """In a process under callgrind (started with ``--instr-atstart=no``, so that imports and model
    building run uninstrumented, faster): :meth:`start` switches instrumentation on, then each
    :meth:`count` leaves the instructions of one call in a dump of its own."""

    def __init__(self, requests: str, dumps: str) -> None:
        self.lib = ctypes.CDLL(requests)
        if not self.lib.on_valgrind():
            raise RuntimeError("not running under valgrind: start this process with count_table()")
        self.dumps = dumps  # callgrind's --callgrind-out-file; its Nth dump is written to dumps.N
        self.n = 0

    def start(self) -> None:
        self.lib.start_instrumentation()

    def count(self, call: Callable[[], object]) -> Path:
        """Count ``call()``; returns the dump callgrind wrote, to read (:func:`read_total`) after the
        counted rounds: reading a dump between two counted calls would leave its memory churn to the
        next one. A collection first, uncounted, so each call starts with the garbage collector's
        counts at zero: the collections it triggers are its own, and the same every time, wherever
        the last one left off."""
        gc.collect()
        self.lib.zero_stats()
        call()
        self.lib.dump_stats()
        self.n += 1
        return Path(f"{self.dumps}.{self.n}")


def _total(dump_text: str, dump: Path) -> int:
    for line in dump_text.splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals line in callgrind's dump {dump}")


def read_total(dump: Path) -> int:
    """The instruction count in one of callgrind's dumps (its ``totals:`` line)."""
    return _total(dump.read_text(), dump)


def read_counts(dump: Path) -> tuple[int, int]:
    """A dump's instruction count and those of them in the allocators (:func:`in_allocators`),
    from one read of the dump."""
    text = dump.read_text()
    return _total(text, dump), in_allocators(self_costs(text))


def self_costs(dump_text: str) -> dict[str, int]:
    """The instructions each function executed itself (its callees' left out), from a callgrind dump:
    the cost lines under each ``fn=``, except those right after a ``calls=`` line (a call's
    inclusive cost). Names are compressed: ``fn=(7) name`` the first time, ``fn=(7)`` after."""
    names: dict[str, str] = {}
    costs: dict[str, int] = {}
    current, call_cost = "", False
    for line in dump_text.splitlines():
        key, _, rest = line.partition("=")
        if key in ("fn", "cfn"):
            ident, _, name = rest.partition(" ")
            if name:
                names[ident] = name
            if key == "fn":
                current, call_cost = names.get(ident, ident), False
        elif key == "calls":
            call_cost = True
        elif line[:1].isdigit() or line[:1] in "+-*":  # a position, then the cost (none: 0)
            parts = line.split()
            if call_cost:
                call_cost = False
            elif len(parts) > 1:
                costs[current] = costs.get(current, 0) + int(parts[1])
    return costs


#: The memory allocators' own functions: the C library's malloc and CPython's pymalloc. What they
#: execute depends on the heap's state (which free list a block comes from, when chunks are merged),
#: not only on the call: most of what the same call's count varies by from one round to the next.
ALLOCATORS = re.compile(
    r"(__libc_)?(malloc|free|calloc|realloc|memalign|posix_memalign)|_int_(malloc|free|realloc|memalign)"
    r"|malloc_consolidate|unlink_chunk.*|_mid_memalign.*|sysmalloc.*|tcache_.*"
    r"|_?PyObject_(Malloc|Free|Realloc|Calloc)"
)


def in_allocators(costs: dict[str, int]) -> int:
    """The instructions of ``costs`` (:func:`self_costs`) executed in the :data:`ALLOCATORS`."""
    return sum(n for name, n in costs.items() if ALLOCATORS.fullmatch(name))


def avx2_share(dump: Path) -> float:
    """The share of a dump's instructions executed in AVX2 code: the functions whose name says so
    (MKL's ``mkl_blas_avx2_*``, torch's ``at::native::AVX2::*``, the C library's ``*_avx2``), the
    code whose instruction count would change where a CPU runs wider vectors natively."""
    costs = self_costs(dump.read_text())
    return sum(n for name, n in costs.items() if "avx2" in name.lower()) / max(1, sum(costs.values()))


def _under_callgrind(job: str, *args: str) -> Any:
    """What the child ``python -m bench.instructions JOB ARGS...`` returns (as JSON), run under
    callgrind with instrumentation off until it starts it."""
    reason = missing()
    if reason:
        raise RuntimeError(f"counting instructions {reason}")
    with tempfile.TemporaryDirectory(prefix="stopcock-callgrind-") as folder:
        requests = Path(folder) / "requests.so"
        source = Path(folder) / "requests.c"
        source.write_text(REQUESTS_C)
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(requests), str(source)], check=True)
        dumps, out = Path(folder) / "callgrind.out", Path(folder) / "out.json"
        command = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-line=no", "--dump-instr=no",
            f"--callgrind-out-file={dumps}", sys.executable, "-m", "bench.instructions",
            job, str(requests), str(dumps), str(out), *args,
        ]
        # a fixed hash seed: the same code counts the same instructions in the next run
        env = {**os.environ, "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            what = " ".join([job, *args])
            raise RuntimeError(f"counting {what} under callgrind failed:\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def count_table(table: Throughput, rounds: int, warmup: int = 1) -> tuple[Counted, float]:
    """The instructions of each call of ``table``'s arms (a :class:`bench.overhead.Throughput`, on
    the CPU): ``warmup`` rounds, then ``rounds`` interleaved rounds, in a new process under
    callgrind; and the seconds that took."""
    started = time.monotonic()
    counted = Counted(**_under_callgrind("table", json.dumps(asdict(table)), str(rounds), str(warmup)))
    return counted, time.monotonic() - started


def count_checks(calls: int) -> dict[str, float]:
    """:func:`bench.overhead.check_costs` in instructions per call (:class:`Counting`), in a new
    process under callgrind."""
    costs: dict[str, float] = _under_callgrind("checks", str(calls))
    return costs


def count_tables(jobs: list[tuple[Throughput, int]], warmup: int = 1) -> list[tuple[Counted, float]]:
    """:func:`count_table` of each (table, rounds), as many at once as the machine has cores (a count
    does not depend on what else runs), started in the order given."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda job: count_table(job[0], job[1], warmup), jobs))


@dataclass
class Counting:
    """The direct per-call costs (:class:`bench.overhead.Measure`) in instructions, under callgrind:
    a batch of ``calls`` calls counted, less the same loop calling nothing; what a variant adds, its
    batch less the base's. Each batch is the median of three counts."""

    callgrind: Callgrind
    unit: str = "instructions"

    def _batch(self, fn: Callable[[], object], calls: int,
               within: Callable[[], Any] = contextlib.nullcontext) -> float:
        def loop() -> None:
            for _ in range(calls):
                fn()

        with within():
            return statistics.median(read_total(self.callgrind.count(loop)) for _ in range(3))

    def per_call(self, fn: Callable[[], object], calls: int) -> float:
        return (self._batch(fn, calls) - self._batch(lambda: None, calls)) / calls

    def added(self, base: Callable[[], object], variant: Callable[[], object], calls: int,
              within: Callable[[], Any] = contextlib.nullcontext) -> float:
        return (self._batch(variant, calls, within) - self._batch(base, calls)) / calls


def _counted_share(spec: str, rounds: int, warmup: int, callgrind: Callgrind) -> Counted:
    """Under callgrind: the arms of the table ``spec`` describes, built here, counted in rounds; and
    the AVX2 share of the plain call's last count."""
    from .common import CPU, frozen_heap, interleaved, quiet
    from .overhead import PLAIN, Throughput, build_arms

    fields = json.loads(spec)
    table = Throughput(**{**fields, "shape": tuple(fields["shape"])})
    with quiet():
        arms = build_arms(table, CPU, measure=callgrind.count)
        # Uncounted and short (one step), until every code path of every arm has run often enough for
        # Python to specialise its bytecode (after 8 calls of a function): code that a run executes
        # once a call would otherwise count more in the first rounds than in the last.
        interleaved(build_arms(replace(table, steps=1), CPU), 0, warmup=QUICKENED)
        callgrind.start()
        interleaved(arms, 0, warmup=warmup)
        with frozen_heap():
            counted = interleaved(arms, rounds, warmup=0)
    read = {name: [read_counts(dump) for dump in made] for name, made in counted.items()}
    return Counted(
        counts={name: [total for total, _ in pairs] for name, pairs in read.items()},
        allocators={name: [allocated for _, allocated in pairs] for name, pairs in read.items()},
        avx2_share=avx2_share(counted[PLAIN][-1]),
    )


def _counted_checks(calls: int, callgrind: Callgrind) -> dict[str, float]:
    """Under callgrind: :func:`bench.overhead.check_costs`, counted."""
    from .common import frozen_heap, quiet
    from .overhead import check_costs

    with quiet():
        counting = Counting(callgrind)
        check_costs(calls, counting)  # a first pass, uncounted: imports, the pipeline, warm paths
        callgrind.start()
        with frozen_heap():
            return check_costs(calls, counting)


if __name__ == "__main__":
    job, requests, dumps, out, *args = sys.argv[1:]
    callgrind = Callgrind(requests, dumps)
    if job == "table":
        result: Any = asdict(_counted_share(args[0], int(args[1]), int(args[2]), callgrind))
    else:
        result = _counted_checks(int(args[0]), callgrind)
    Path(out).write_text(json.dumps(result))
