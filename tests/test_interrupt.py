"""``stop=stopcock.interrupted()``: Ctrl+C (SIGINT) stops the run and keeps its partial; a second
press raises KeyboardInterrupt; the handler lives only as long as the run, on the main thread.

In this process (a SIGINT raised from ``on_step``, so the step it lands on is known), in a child
process sent real SIGINTs from outside (the ``examples/ctrl_c.py`` script, and a step held in
:mod:`tiny.slow` for the second press), and in a real Jupyter kernel interrupted by its manager
(the cells of ``examples/interrupt.ipynb``).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import stopcock
from stopcock.conditions import AnyOf, Signalled
from stopcock.interrupt import Interrupted, take

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
WAIT = 120  # the longest any wait here may take (a broken stop fails instead of hanging)


def _generate(model, tokenizer, **options):
    inputs = tokenizer("Beautiful is", return_tensors="pt")
    return stopcock.run(model, **inputs, tokenizer=tokenizer, min_new_tokens=40, max_new_tokens=40, **options)


# -- binding ----------------------------------------------------------------------------------------
def test_take_swaps_interrupted_for_a_new_signal_of_each_run():
    button = stopcock.StopSignal()
    assert take(None) == (None, None)
    assert take(button) == (button, None)
    plain = stopcock.timeout(5)
    assert take(plain) == (plain, None)
    stop, pressed = take(stopcock.interrupted())
    assert isinstance(pressed, stopcock.StopSignal) and stop is pressed
    _, other = take(stopcock.interrupted())
    assert other is not pressed  # one condition, a signal per run
    for given in (button | stopcock.interrupted(), [button, stopcock.interrupted()]):
        stop, pressed = take(given)
        assert isinstance(stop, AnyOf)
        assert [c.signal for c in stop.conditions if isinstance(c, Signalled)] == [button, pressed]
        assert not any(isinstance(c, Interrupted) for c in stop.parts())


def test_interrupted_inside_an_and_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"combine it with \| instead"):
        take(stopcock.interrupted() & stopcock.max_steps(3))


def test_an_interrupted_that_was_not_bound_by_run_says_so_when_checked():
    with pytest.raises(TypeError, match=r"works in stopcock.run\(\) and stopcock.resume\(\)"):
        stopcock.interrupted().check(stopcock.StepState())


# -- in this process ------------------------------------------------------------------------------------
@pytest.mark.timeout(WAIT)
def test_a_press_stops_the_run_at_that_step_and_keeps_the_partial(text_model, tokenizer):
    before = signal.getsignal(signal.SIGINT)
    during = []

    def press_at_five(state):
        during.append(signal.getsignal(signal.SIGINT))
        if state.step == 5:
            signal.raise_signal(signal.SIGINT)  # the handler runs here, on this (the main) thread

    outcome = _generate(text_model, tokenizer, stop=stopcock.interrupted(), on_step=press_at_five)
    assert outcome.stopped and outcome.reason == "interrupted"
    assert outcome.steps == 5
    prompt = tokenizer("Beautiful is", return_tensors="pt")["input_ids"].shape[1]
    assert outcome.output.shape[1] == prompt + 5  # the five tokens made before the press are kept
    assert all(h is not before for h in during)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.timeout(WAIT)
def test_a_second_press_raises_keyboard_interrupt_and_restores_the_handler(text_model, tokenizer):
    before = signal.getsignal(signal.SIGINT)

    def press_twice_at_three(state):
        if state.step == 3:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        _generate(text_model, tokenizer, stop=stopcock.interrupted(), on_step=press_twice_at_three)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.timeout(WAIT)
def test_a_resumed_run_is_interrupted_the_same_way(text_model, tokenizer):
    before = signal.getsignal(signal.SIGINT)
    stopped = _generate(text_model, tokenizer, stop=stopcock.max_steps(3), checkpoint=True)

    def press_at_seven(state):
        if state.step == 7:
            signal.raise_signal(signal.SIGINT)

    stop = stopcock.interrupted()
    resumed = stopcock.resume(text_model, stopped.checkpoint, stop=stop, on_step=press_at_seven)
    assert (resumed.reason, resumed.steps) == ("interrupted", 7)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.timeout(WAIT)
def test_other_stops_still_work_beside_it_and_nothing_stays_installed(text_model, tokenizer):
    before = signal.getsignal(signal.SIGINT)
    button = stopcock.StopSignal()

    def click_at_four(state):
        if state.step == 4:
            button.stop("user")

    outcome = _generate(text_model, tokenizer, stop=button | stopcock.interrupted(), on_step=click_at_four)
    assert (outcome.reason, outcome.steps) == ("user", 4)
    complete = _generate(text_model, tokenizer, stop=[stopcock.interrupted()])
    assert (complete.stopped, complete.steps) == (False, 40)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.timeout(WAIT)
def test_off_the_main_thread_is_a_clear_error(text_model, tokenizer):
    errors: queue.Queue[BaseException | None] = queue.Queue()

    def off_main() -> None:
        try:
            _generate(text_model, tokenizer, stop=stopcock.interrupted())
        except RuntimeError as exc:
            errors.put(exc)
        else:
            errors.put(None)

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join(WAIT)
    error = errors.get(timeout=1)
    assert error is not None and "main thread only" in str(error) and "StopSignal" in str(error)
    inputs = tokenizer("Beautiful is", return_tensors="pt")
    with pytest.raises(RuntimeError, match="main thread only"):  # a stream runs in a worker thread
        list(stopcock.stream(text_model, **inputs, tokenizer=tokenizer, max_new_tokens=3,
                             stop=stopcock.interrupted()))


# -- a child process, sent SIGINT from outside ---------------------------------------------------------
class _Reader:
    """Collects a child's stream in a thread; :meth:`wait_for` blocks (bounded) until a text shows."""

    def __init__(self, stream) -> None:
        self.text = ""
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            with self._changed:
                self.text += chunk.decode(errors="replace")
                self._changed.notify_all()

    def wait_for(self, text: str) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: text in self.text, timeout=WAIT):
                raise AssertionError(f"{text!r} never showed; got {self.text[-2000:]!r}")

    def join(self) -> str:
        self._thread.join(WAIT)
        return self.text


def _child(*args: str) -> tuple[subprocess.Popen[bytes], _Reader, _Reader]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    return process, _Reader(process.stdout), _Reader(process.stderr)


@pytest.mark.timeout(WAIT * 2)
def test_the_example_script_keeps_the_partial_image_on_ctrl_c(tmp_path):
    out = tmp_path / "digit.png"
    process, stdout, stderr = _child(str(EXAMPLES / "ctrl_c.py"), "--out", str(out), "--json")
    try:
        stderr.wait_for("step 3/1000")
        process.send_signal(signal.SIGINT)
        assert process.wait(WAIT) == 0, stderr.join()
    finally:
        process.kill()
    summary = json.loads(stdout.join())
    assert summary["stopped"] and summary["reason"] == "interrupted"
    assert 3 <= summary["steps"] < 1000 and summary["partial"] == "denoised"
    assert "stopcock: interrupted: stopping at the next step" in stderr.join()
    from PIL import Image

    assert Image.open(out).size == (256, 256)


HELD = r"""
import signal, sys, torch, stopcock
from stopcock.loading import load_image_pipeline, resolve_model
from tiny.slow import SlowLayer, slow_down

torch.set_num_threads(1)
pipe = load_image_pipeline(resolve_model(None, "image"), quiet=True)
layer = slow_down(pipe.unet, "conv_in", SlowLayer(hold_at=5))  # the 6th denoising step is held

def held(state):
    if state.step == 5:
        print("held", file=sys.stderr, flush=True)

try:
    stopcock.run(pipe, "7", num_inference_steps=50, stop=stopcock.interrupted(), on_step=held)
except KeyboardInterrupt:
    restored = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    print(f"KeyboardInterrupt restored={restored}", flush=True)
    sys.exit(3)
print("returned", flush=True)
"""


@pytest.mark.timeout(WAIT * 2)
def test_a_second_ctrl_c_during_a_held_step_raises_keyboard_interrupt():
    process, stdout, stderr = _child("-c", HELD)
    try:
        stderr.wait_for("held")
        process.send_signal(signal.SIGINT)
        stderr.wait_for("stopcock: interrupted")  # the first press was handled: the run is stopping
        process.send_signal(signal.SIGINT)
        assert process.wait(WAIT) == 3, stderr.join()
    finally:
        process.kill()
    assert stdout.join().strip() == "KeyboardInterrupt restored=True"


# -- a real Jupyter kernel ---------------------------------------------------------------------------------
def _cells() -> list[str]:
    notebook = json.loads((EXAMPLES / "interrupt.ipynb").read_text())
    return ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]


@pytest.mark.timeout(WAIT * 3)
def test_a_notebook_interrupt_keeps_the_partial_in_a_real_kernel():
    pytest.importorskip("ipykernel")
    pytest.importorskip("jupyter_client")
    from jupyter_client.manager import KernelManager

    setup, long_run, show, text = _cells()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env=env, cwd=str(ROOT))
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=WAIT)
        assert _execute(client, setup)["status"] == "ok"

        # the long cell: interrupt it once it reports progress
        msg_id = client.execute(long_run)
        printed = _until_output(client, msg_id, "step 100/1000")
        manager.interrupt_kernel()
        reply = client.get_shell_msg(timeout=WAIT)
        assert reply["parent_header"]["msg_id"] == msg_id
        assert reply["content"]["status"] == "ok", reply["content"]  # no KeyboardInterrupt: kept
        printed += _drain(client, msg_id)
        assert "stopped (interrupted)" in printed

        reply = _execute(client, show)
        assert reply["status"] == "ok", reply
        reason, steps, total = reply["stdout"].split()
        assert reason == "interrupted" and 100 <= int(steps) < int(total) == 1000
        assert reply["image/png"]  # the partial image, shown by the cell

        reply = _execute(client, text)  # the notebook's last cell: text, run to its end here
        assert reply["status"] == "ok", reply
        assert reply["stdout"].startswith(("length ", "eos ")) and "Beautiful is" in reply["stdout"]

        reply = _execute(client, "import signal; print(signal.getsignal(signal.SIGINT).__class__.__name__)")
        assert "_Handler" not in reply["stdout"]  # nothing of the run's is left installed
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _execute(client, code: str) -> dict:
    """Run a cell; its reply's content with what it printed (``stdout``) and its display data."""
    msg_id = client.execute(code)
    reply = client.get_shell_msg(timeout=WAIT)
    assert reply["parent_header"]["msg_id"] == msg_id
    found = dict(reply["content"])
    found["stdout"] = ""
    for message in _messages(client, msg_id):
        content = message["content"]
        if message["msg_type"] == "stream" and content["name"] == "stdout":
            found["stdout"] += content["text"]
        elif message["msg_type"] in ("execute_result", "display_data"):
            found.update(content["data"])
    return found


def _messages(client, msg_id: str):
    """The cell's iopub messages up to its idle status."""
    while True:
        message = client.get_iopub_msg(timeout=WAIT)
        if message["parent_header"].get("msg_id") != msg_id:
            continue
        if message["msg_type"] == "status" and message["content"]["execution_state"] == "idle":
            return
        yield message


def _until_output(client, msg_id: str, text: str) -> str:
    printed = ""
    for message in _messages(client, msg_id):
        if message["msg_type"] == "stream":
            printed += message["content"]["text"]
            if text in printed:
                return printed
        if message["msg_type"] == "error":
            raise AssertionError(message["content"])
    raise AssertionError(f"the cell ended before printing {text!r}: {printed!r}")


def _drain(client, msg_id: str) -> str:
    return "".join(m["content"]["text"] for m in _messages(client, msg_id) if m["msg_type"] == "stream")
