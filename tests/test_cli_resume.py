"""``stopcock image --checkpoint FILE`` and ``stopcock resume FILE``: Ctrl+C once (a real subprocess
and a real SIGINT) saves a checkpoint beside the partial image, and the resume, in another process,
saves the image an uninterrupted run makes, pixel for pixel; a resume stopped again checkpoints again.
The runs that need neither a signal nor a new process call the CLI's ``main`` in this process."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from test_cli import ACK_ONCE, Held, cli, png_metadata  # tests/ is on sys.path under pytest

from stopcock.cli import EXIT_COMPLETED, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_STOPPED, EXIT_USAGE, main

STEPS = "24"


@pytest.fixture
def in_process(capsys):
    """The CLI's ``main(args)`` in this process: (exit code, stdout, stderr)."""
    return lambda *args: (main(list(args)), *capsys.readouterr())


def pixels(path) -> bytes:
    with Image.open(path) as image:
        return image.convert("RGB").tobytes()


def test_ctrl_c_once_saves_a_checkpoint_and_resume_finishes_the_same_image(in_process, tmp_path):
    full = tmp_path / "full.png"
    assert in_process("image", "--prompt", "7", "--steps", STEPS, "--seed", "3", "--out", str(full))[0] == 0
    out, checkpoint = tmp_path / "stopped.png", tmp_path / "run.safetensors"
    run = Held(["image", "--prompt", "7", "--steps", STEPS, "--seed", "3", "--out", str(out), "--checkpoint",
                str(checkpoint), "--json"], "hold:UNet2DConditionModel:5")
    run.wait_for("gate: holding forward 5")
    run.interrupt()
    run.wait_for(ACK_ONCE)
    run.release()
    code, stdout, _ = run.finish()
    report = json.loads(stdout)
    assert code == EXIT_INTERRUPTED and report["checkpoint"] == str(checkpoint) and report["steps"] == 5
    assert png_metadata(out)["image"] == "partial" and checkpoint.exists()

    resumed = cli("resume", str(checkpoint), "--out", str(tmp_path / "resumed.png"), "--json")  # new process
    assert resumed.returncode == EXIT_COMPLETED, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["resumed"] == {"from_step": 5, "saved_steps": 5, "exact": True, "how": "replay"}
    assert (report["command"], report["steps"], report["image"]) == ("resume", int(STEPS), "complete")
    assert pixels(tmp_path / "resumed.png") == pixels(full)
    meta = png_metadata(tmp_path / "resumed.png")
    assert (meta["prompt"], meta["seed"], meta["resumed"]["from_step"]) == ("7", 3, 5)


def test_a_resume_stopped_again_checkpoints_again(in_process, tmp_path):
    full = tmp_path / "full.png"
    assert in_process("image", "--prompt", "4", "--steps", STEPS, "--out", str(full))[0] == EXIT_COMPLETED
    checkpoint = tmp_path / "run.safetensors"
    code, _, err = in_process("image", "--prompt", "4", "--steps", STEPS, "--stop-at-step", "6", "--out",
                            str(tmp_path / "a.png"), "--checkpoint", str(checkpoint))
    assert code == EXIT_STOPPED and f"`stopcock resume {checkpoint}`" in err
    code, stdout, err = in_process("resume", str(checkpoint), "--stop-at-step", "15", "--json")
    assert code == EXIT_STOPPED, err
    report = json.loads(stdout)
    assert report["steps"] == 15 and report["file"] == str(tmp_path / "a.png")  # the first run's --out
    code, stdout, _ = in_process("resume", str(checkpoint), "--out", str(tmp_path / "b.png"), "--json")
    assert code == EXIT_COMPLETED and json.loads(stdout)["resumed"]["from_step"] == 15
    assert pixels(tmp_path / "b.png") == pixels(full)


def test_resume_refuses_what_it_cannot_resume(in_process, tmp_path):
    code, _, err = in_process("resume", str(tmp_path / "nope.safetensors"))
    assert code == EXIT_ERROR and "cannot resume" in err and "Traceback" not in err
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    code, _, err = in_process("resume", str(tmp_path / "junk.safetensors"))
    assert code == EXIT_ERROR and "not a stopcock checkpoint" in err
    code, stdout, _ = in_process("image", "--prompt", "1", "--steps", "3", "--out", str(tmp_path / "c.png"),
                               "--checkpoint", str(tmp_path / "c.safetensors"), "--json")
    assert json.loads(stdout)["checkpoint"] is None  # completed: nothing to resume, no file
    assert not (tmp_path / "c.safetensors").exists()
    assert cli("resume").returncode == EXIT_USAGE
