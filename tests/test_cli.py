"""The command line, run as a subprocess the way people run it.

Runs that must be caught mid-way are held by a gate, never timed: the child process installs a
global forward pre-hook (test code, passed with ``python -c``) that, at the N-th forward of the
chosen model, says so on stderr and then blocks reading stdin. The test sends SIGINT while the run
is held, waits for the CLI's acknowledgement on stderr, then either releases the gate (one Ctrl+C)
or sends a second SIGINT (two). The step the run stops at is therefore exact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image

from stopcock.cli import (
    EXIT_CODES,
    EXIT_COMPLETED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    EXIT_USAGE,
)

# The gate, run in the child before the CLI: CLI_TEST_GATE holds comma-separated specs.
# "hold:CLASS:N" blocks the N-th forward of a module of class CLASS until a line arrives on stdin;
# "slow:CLASS:SECONDS" makes every forward of CLASS take at least SECONDS (a slow model, for the
# timeout test); "load:CLASS:-" blocks transformers' CLASS.from_pretrained (model loading) and
# "save:-:-" blocks PIL's Image.save the same way, then each goes on.
GATE = """
import os, sys, time
from torch.nn.modules.module import register_module_forward_pre_hook

def hold(what):
    print(f"gate: holding {what}", file=sys.stderr, flush=True)
    sys.stdin.readline()

def held(owner, name, what):
    real = getattr(owner, name)
    def call(*args, **kwargs):
        hold(what)
        return real(*args, **kwargs)
    setattr(owner, name, call)

def forward_gate(mode, cls, arg):
    calls = 0
    def gate(module, args):
        nonlocal calls
        if type(module).__name__ != cls:
            return
        calls += 1
        if mode == "slow":
            time.sleep(float(arg))
        elif calls == int(arg):
            hold(f"forward {calls}")
    register_module_forward_pre_hook(gate)

for spec in os.environ["CLI_TEST_GATE"].split(","):
    mode, cls, arg = spec.split(":")
    if mode == "load":
        import transformers
        held(getattr(transformers, cls), "from_pretrained", "the load")
    elif mode == "save":
        from PIL import Image
        held(Image.Image, "save", "the save")
    else:
        forward_gate(mode, cls, arg)
from stopcock.cli import main
sys.exit(main(sys.argv[1:]))
"""

ACK_ONCE = "Ctrl+C again to abort now"
ACK_TWICE = "aborting now"
PROMPT = "Beautiful is"


def child_env(gate: str | None = None) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if gate is not None:
        env["CLI_TEST_GATE"] = gate
    return env


def cli(*args: str, gate: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", GATE] if gate else [sys.executable, "-m", "stopcock"]
    return subprocess.run([*command, *args], capture_output=True, text=True, env=child_env(gate),
                          timeout=600, stdin=subprocess.DEVNULL)


class Held:
    """A CLI child run through the gate, with stderr read line by line as it comes."""

    def __init__(self, args: list[str], gate: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", GATE, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=child_env(gate))
        self.stderr: list[str] = []
        self.watchdog = threading.Timer(600, self.proc.kill)  # a safety net for a broken child, not a sync
        self.watchdog.start()

    def wait_for(self, text: str) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            self.stderr.append(raw.decode())
            if text in self.stderr[-1]:
                return
        raise AssertionError(f"the CLI ended before printing {text!r}:\n{''.join(self.stderr)}")

    def streamed(self) -> str:
        """What the child has written to stdout so far (it flushes as it goes)."""
        assert self.proc.stdout is not None
        return self.proc.stdout.read1(1 << 16).decode()

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def release(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()

    def finish(self) -> tuple[int, str, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        out = self.proc.stdout.read().decode()
        err = "".join(self.stderr) + self.proc.stderr.read().decode()
        code = self.proc.wait()
        self.watchdog.cancel()
        return code, out, err


def png_metadata(path: Path) -> dict:
    with Image.open(path) as image:
        return json.loads(image.text["stopcock"])


# -- arguments and errors -------------------------------------------------------------------------


def test_help_documents_exit_codes_and_json():
    top = cli("--help")
    assert top.returncode == 0
    for code in EXIT_CODES:
        assert f"  {code} " in top.stdout
    text_help = cli("text", "--help")
    assert "--json prints one JSON object" in text_help.stdout and "exit_code" in text_help.stdout


def test_exit_codes_are_distinct():
    assert len({EXIT_COMPLETED, EXIT_ERROR, EXIT_USAGE, EXIT_STOPPED, EXIT_INTERRUPTED}) == 5


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["text"], "--prompt"),
        (["text", "--prompt", "x", "--timeout", "-1"], "--timeout"),
        (["text", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["text", "--prompt", "x", "--mode", "fast"], "--mode"),
        (["text", "--prompt", "x", "--stop", ""], "--stop"),
        (["image", "--prompt", "x", "--steps", "many"], "--steps"),
        (["image", "--prompt", "x", "--partial", "half"], "--partial"),
        (["image", "--prompt", "x", "--seed", str(2**64)], "--seed"),
        (["frobnicate"], "frobnicate"),
        ([], "COMMAND"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(args, named):
    result = cli(*args)
    assert result.returncode == EXIT_USAGE
    assert named in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_model_path_is_a_clear_error(tmp_path):
    result = cli("text", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert result.returncode == EXIT_ERROR
    assert f"model folder not found: {tmp_path / 'nope'}" in result.stderr
    assert "Traceback" not in result.stderr


def test_hub_id_offline_is_a_clear_error(run_main):
    code, _, err = run_main("text", "--model", "no-such-org/no-such-model", "--prompt", "x")
    assert code == EXIT_ERROR
    assert "'no-such-org/no-such-model' is not a local folder" in err
    assert "HF_HUB_OFFLINE is set" in err


def test_steps_the_scheduler_cannot_plan_is_a_usage_error(run_main, tmp_path):
    out = tmp_path / "never.png"
    code, stdout, err = run_main("image", "--prompt", "7", "--steps", "5000", "--out", str(out))
    assert code == EXIT_USAGE and stdout == ""
    assert "--steps 5000: this model's DDIMScheduler cannot plan 5000 steps" in err
    assert "pass a smaller --steps" in err and "Traceback" not in err
    assert not out.exists()


def test_an_empty_prompt_is_a_usage_error(run_main):
    code, stdout, err = run_main("text", "--prompt", "", "--json")
    assert code == EXIT_USAGE and stdout == ""
    assert "--prompt '' is no tokens" in err and "Traceback" not in err


def test_an_out_path_that_cannot_be_written_fails_before_the_run(run_main, tmp_path):
    code, stdout, err = run_main("image", "--prompt", "7", "--out", str(tmp_path), "--progress", "lines")
    assert code == EXIT_ERROR and stdout == ""
    assert f"--out {tmp_path} is a folder" in err and "step " not in err  # no step was run


def test_python_m_stopcock_cli_is_the_same_cli_as_python_m_stopcock(tmp_path):
    """``python -m stopcock.cli`` runs the module a second time as __main__; a CliError raised by the rest
    of the package (here the demo's check of --out) must still be a clear error, not a traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for module in ("stopcock", "stopcock.cli"):
        result = subprocess.run([sys.executable, "-m", module, "demo", "--out", str(blocker / "demo.png")],
                                capture_output=True, text=True, env=child_env(), timeout=600)
        assert result.returncode == EXIT_ERROR, result.stderr
        assert f"stopcock: error: cannot write --out {blocker / 'demo.png'}" in result.stderr
        assert "Traceback" not in result.stderr and "stopcock demo:" not in result.stdout


def test_folder_of_the_wrong_kind_is_a_clear_error(run_main, tmp_path):
    code, _, err = run_main("text", "--model", str(tmp_path), "--prompt", "x")
    assert code == EXIT_ERROR
    assert f"cannot load the model in {tmp_path}" in err


# -- text ------------------------------------------------------------------------------------------


def test_text_completes_and_streams_to_stdout(run_main, zen_text):
    code, out, err = run_main("text", "--prompt", PROMPT, "--max-new-tokens", "12")
    assert code == EXIT_COMPLETED, err
    assert out == zen_text(12) + "\n"
    assert "completed (length) after 12 of 12 tokens" in err


def test_text_stop_string_json(zen_text):
    result = cli("text", "--prompt", PROMPT, "--stop", ".", "--json")
    assert result.returncode == EXIT_STOPPED, result.stderr
    report = json.loads(result.stdout)  # stdout holds exactly one JSON object
    assert report["command"] == "text" and report["stopped"] is True
    assert report["reason"] == "stop_string"
    assert report["text"] == " better than ugly."  # the trained model's words; the stop string is kept
    assert report["text"] == zen_text(report["steps"])
    assert report["exit_code"] == EXIT_STOPPED and report["total_steps"] == 100
    assert {"elapsed", "stop_latency", "mode", "partial", "row_reasons", "detail", "model"} <= set(report)


def test_text_max_steps(run_main, zen_text):
    code, out, _ = run_main("text", "--prompt", PROMPT, "--max-steps", "5", "--json")
    report = json.loads(out)
    assert code == EXIT_STOPPED
    assert (report["reason"], report["steps"], report["text"]) == ("max_steps", 5, zen_text(5))


def test_text_timeout_on_a_slow_model(zen_text):
    # every forward takes >= 20 ms, so 500 tokens take >= 10 s: the 0.3 s timeout must end the run
    result = cli("text", "--prompt", PROMPT, "--max-new-tokens", "500", "--timeout", "0.3", "--json",
                 gate="slow:GPT2LMHeadModel:0.02")
    assert result.returncode == EXIT_STOPPED, result.stderr
    report = json.loads(result.stdout)
    assert report["reason"] == "timeout" and report["stopped"] is True
    assert report["steps"] < 500 and report["text"] == zen_text(report["steps"])


def test_text_ctrl_c_once_stops_at_the_next_token(zen_text):
    run = Held(["text", "--prompt", PROMPT, "--max-new-tokens", "500"], "hold:GPT2LMHeadModel:4")
    run.wait_for("gate: holding forward 4")
    assert run.streamed() == zen_text(3)  # three tokens were printed before the fourth forward
    run.interrupt()
    run.wait_for(ACK_ONCE)
    run.release()
    code, out, err = run.finish()
    assert code == EXIT_INTERRUPTED
    assert out == zen_text(4)[len(zen_text(3)):] + "\n"  # the token in flight completes, then it stops
    assert "stopped (interrupted) after 4 of 500 tokens" in err and "mode finish" in err


def test_text_ctrl_c_twice_aborts_inside_the_forward(zen_text):
    run = Held(["text", "--prompt", PROMPT, "--max-new-tokens", "500", "--json"],
               "hold:GPT2LMHeadModel:4")
    run.wait_for("gate: holding forward 4")
    run.interrupt()
    run.wait_for(ACK_ONCE)
    run.interrupt()
    run.wait_for(ACK_TWICE)
    code, out, _ = run.finish()
    report = json.loads(out)
    assert code == EXIT_INTERRUPTED == report["exit_code"]
    assert (report["reason"], report["mode"], report["steps"]) == ("interrupted", "abort", 3)
    assert report["text"] == zen_text(3)  # what the finished tokens made; the fourth never came


def test_text_ctrl_c_while_loading_still_prints_the_json():
    run = Held(["text", "--prompt", PROMPT, "--json"], "load:AutoModelForCausalLM:-")
    run.wait_for("gate: holding the load")
    run.interrupt()
    code, out, err = run.finish()
    report = json.loads(out)  # stdout holds exactly one JSON object
    assert code == EXIT_INTERRUPTED == report["exit_code"]
    assert (report["reason"], report["stopped"], report["steps"]) == ("interrupted", True, 0)
    assert report["text"] == ""
    assert "while loading the model" in report["detail"] and "Traceback" not in err


# -- image -----------------------------------------------------------------------------------------


def test_image_completes_with_the_outcome_in_the_png(run_main, tmp_path):
    out = tmp_path / "full.png"
    code, stdout, err = run_main("image", "--prompt", "7", "--steps", "4", "--out", str(out), "--json")
    assert code == EXIT_COMPLETED, err
    report = json.loads(stdout)
    assert (report["reason"], report["steps"], report["image"], report["file"]) == (
        "completed", 4, "complete", str(out))
    meta = png_metadata(out)
    assert meta["stopped"] is False and meta["steps"] == 4 and meta["prompt"] == "7"


def test_image_seed_makes_the_run_repeatable(run_main, tmp_path):
    def image(seed: str, name: str) -> bytes:
        out = tmp_path / name
        code, _, err = run_main("image", "--prompt", "7", "--steps", "4", "--seed", seed, "--out", str(out))
        assert code == EXIT_COMPLETED, err
        return Image.open(out).convert("RGB").tobytes()

    first, again, other = image("5", "a.png"), image("5", "b.png"), image("6", "c.png")
    assert first == again
    assert first != other


def test_image_stop_at_step_progress_lines(run_main, tmp_path):
    out = tmp_path / "stopped.png"
    code, _, err = run_main("image", "--prompt", "7", "--steps", "20", "--stop-at-step", "3", "--partial",
                            "raw", "--progress", "lines", "--out", str(out))
    assert code == EXIT_STOPPED, err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/20", "2/20", "3/20"]  # one line per step, then it stops
    assert all(" eta " in line for line in lines)
    assert "saved the partial image" in err
    meta = png_metadata(out)
    assert (meta["reason"], meta["steps"], meta["total_steps"]) == ("max_steps", 3, 20)
    assert meta["partial"] == "raw"


def test_progress_bar_shows_the_step_and_the_eta():
    import io

    from stopcock.cli import Progress
    from stopcock.state import StepState

    progress = Progress("bar")
    progress.stream = io.StringIO()
    progress(StepState(step=5, total=20, elapsed=1.0))  # 0.2 s a step, 15 to go
    progress.close()
    assert progress.stream.getvalue() == f"\rstep 5/20 [{'#' * 7}{'.' * 23}] eta 3.0s   \n"


def test_image_ctrl_c_once_saves_the_partial_image(tmp_path):
    out = tmp_path / "interrupted.png"
    run = Held(["image", "--prompt", "7", "--steps", "200", "--out", str(out), "--json"],
               "hold:UNet2DConditionModel:3,save:-:-")
    run.wait_for("gate: holding forward 3")
    run.interrupt()
    run.wait_for(ACK_ONCE)
    run.release()
    run.wait_for("gate: holding the save")
    run.interrupt()  # an impatient second press once the run has ended must not cut the saving short
    run.wait_for("saving and reporting its result first")
    run.release()
    code, stdout, _ = run.finish()
    report = json.loads(stdout)
    assert code == EXIT_INTERRUPTED == report["exit_code"]
    assert (report["reason"], report["steps"], report["mode"], report["image"]) == (
        "interrupted", 3, "finish", "partial")
    meta = png_metadata(out)
    assert (meta["reason"], meta["steps"], meta["partial"]) == ("interrupted", 3, "denoised")
    with Image.open(out) as image:
        assert image.size == (16, 16)  # the demo model's size


def test_image_ctrl_c_twice_aborts_and_keeps_a_latent_preview(tmp_path):
    out = tmp_path / "aborted.png"
    run = Held(["image", "--prompt", "7", "--steps", "200", "--out", str(out), "--json"],
               "hold:UNet2DConditionModel:3")
    run.wait_for("gate: holding forward 3")
    run.interrupt()
    run.wait_for(ACK_ONCE)
    run.interrupt()
    run.wait_for(ACK_TWICE)
    code, stdout, _ = run.finish()
    report = json.loads(stdout)
    assert code == EXIT_INTERRUPTED
    assert (report["reason"], report["steps"], report["mode"], report["image"]) == (
        "interrupted", 2, "abort", "latent preview")
    assert "abandoned inside step 3" in report["detail"]
    meta = png_metadata(out)
    assert (meta["reason"], meta["steps"], meta["image"]) == ("interrupted", 2, "latent preview")


def test_image_abort_mode_saves_a_latent_preview(run_main, tmp_path):
    out = tmp_path / "abort.png"
    code, stdout, _ = run_main("image", "--prompt", "7", "--steps", "10", "--stop-at-step", "2", "--mode",
                               "abort", "--out", str(out), "--json")
    report = json.loads(stdout)
    assert code == EXIT_STOPPED
    assert (report["mode"], report["image"], report["steps"]) == ("abort", "latent preview", 2)
    assert png_metadata(out)["mode"] == "abort"
