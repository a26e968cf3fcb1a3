"""The command line under Ctrl+C at any moment from launch to exit: the documented exit code and, with
``--json``, exactly one JSON object, every time (issue 11, item 2).

Each trial starts the installed ``stopcock`` command's entry point the way its console script does,
presses Ctrl+C at a random moment 0-3 s after launch, presses again once the run has ended, and
once more as the process exits. The child holds before printing its report until the test lets it
go (a gate in the child, never a sleep), so the first press always lands before the run's result
is out: the run must say "interrupted" (exit 130), or, if the press came after the run had ended,
acknowledge it and report the run as it ended. Bounded here; ``make soak`` runs more.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import stopcock

BOUND = 300  # seconds: a hang guard for one child, never a timing assertion
PACKAGE = str(Path(stopcock.__file__).parent)
ENTRY = tuple(entry_points(group="console_scripts", name="stopcock"))
ENDED_ACK = "the run has ended"

# What the console script does (import the entry point, call it), with a launch marker before it
# and a gate that holds the report until a line arrives on stdin.
PRELUDE = """
import os, sys
os.write(2, b"gate: launched\\n")
from {module} import {attr} as main
import stopcock.cli
report = stopcock.cli.report
def held(*args, **kwargs):
    os.write(2, b"gate: holding the report\\n")
    sys.stdin.readline()
    return report(*args, **kwargs)
stopcock.cli.report = held
sys.exit(main())
"""

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals")


@dataclass
class Trial:
    command: list[str]
    delay: float
    code: int | None = None
    out: str = ""
    err: list[str] = field(default_factory=list)
    hung: bool = False

    def verdict(self) -> str:
        """"interrupted", "after the run", "before the command", or what is wrong."""
        err = "".join(self.err)
        if self.hung:
            return "hang"
        if self.code == -signal.SIGINT and not self.out and "KeyboardInterrupt" in err and PACKAGE not in err:
            return "before the command"  # the interpreter's start-up: no code of stopcock had run
        lines = self.out.splitlines()
        if len(lines) != 1 or "Traceback" in err:
            return f"bad output (exit {self.code}): {self.out!r} {err[-400:]!r}"
        report = json.loads(lines[0])
        if self.code != report["exit_code"]:
            return f"exit {self.code} but the JSON says {report['exit_code']}"
        acks = [line for line in self.err if line.startswith("stopcock: ")]
        if not acks or ENDED_ACK not in acks[-1]:
            return f"the press after the run was not acknowledged: {acks}"
        if self.code == 130 and report["stopped"] and report["reason"] == "interrupted":
            return "interrupted"
        if self.code == 0 and not report["stopped"] and ENDED_ACK in acks[0]:
            return "after the run"  # the first press came once the run had ended: acknowledged
        return f"exit {self.code}, reason {report['reason']!r}, acknowledged {acks}"


def _run(trial: Trial) -> Trial:
    (entry,) = ENTRY
    child = subprocess.Popen(
        [sys.executable, "-c", PRELUDE.format(module=entry.module, attr=entry.attr), *trial.command],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"},
    )
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    launched, settled = threading.Event(), threading.Event()  # settled: holding its report, or ended

    def read_stderr() -> None:
        assert child.stderr is not None
        for line in child.stderr:
            trial.err.append(line)
            launched.set()
            if "gate: holding" in line:
                settled.set()
        launched.set()
        settled.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert launched.wait(BOUND)
        time.sleep(trial.delay)  # the press lands at a random moment from launch (not a sync)
        child.send_signal(signal.SIGINT)
        if settled.wait(BOUND):
            if child.poll() is None:
                child.send_signal(signal.SIGINT)  # a second press, after the run has ended
                child.stdin.write("\n")
                child.stdin.flush()
                trial.out = child.stdout.readline()
                if child.poll() is None:
                    child.send_signal(signal.SIGINT)  # and one as the process exits
            trial.out += child.stdout.read()
            trial.code = child.wait(BOUND)
        else:
            trial.hung = True
    except subprocess.TimeoutExpired:
        trial.hung = True
    finally:
        if trial.hung:
            child.kill()
        child.wait()
        reader.join(BOUND)
    return trial


def test_ctrl_c_at_random_moments_from_launch_gives_the_exit_code_and_the_json(figures, tmp_path):
    if len(ENTRY) != 1:
        pytest.fail("the stopcock command is not installed (pip install -e .)")
    trials = figures.trials(ci=2, soak=60)
    rng = random.Random(0)
    commands = [
        ["text", "--prompt", "Beautiful is", "--json", "--max-new-tokens", "100"],
        ["image", "--prompt", "7", "--steps", "20", "--json"],
    ]
    out = [lambda i: [], lambda i: ["--out", str(tmp_path / f"{i}.png")]]
    plan = [Trial([*commands[i % 2], *out[i % 2](i)], rng.uniform(0, 3)) for i in range(trials)]
    with ThreadPoolExecutor(2) as pool:
        done = list(pool.map(_run, plan))
    verdicts = [t.verdict() for t in done]
    good = {"interrupted", "after the run", "before the command"}
    wrong = [(t.command[0], round(t.delay, 2), v)
             for t, v in zip(done, verdicts, strict=True) if v not in good]
    hangs = verdicts.count("hang")
    figures.record("CLI Ctrl+C at a random moment 0-3 s from launch (then twice more)", trials, "launches",
                   failures={"wrong_exit_code_or_json": len(wrong) - hangs, "hangs": hangs},
                   seen={"stopped by the press": verdicts.count("interrupted"),
                         "pressed once the run had ended": verdicts.count("after the run"),
                         "pressed before the command's first line": verdicts.count("before the command")})
    assert wrong == []
    assert verdicts.count("interrupted") >= 1  # the presses did land while the commands ran


def test_a_busy_port_fails_before_loading_models_with_exit_code_1():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "stopcock", "serve", "--port", str(port), "--text-model", "/nonexistent"],
            capture_output=True, text=True, timeout=BOUND, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "another --port" in result.stderr
    assert "model folder not found" not in result.stderr  # refused before the models were looked at
