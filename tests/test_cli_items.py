"""The command line with several prompts: run one after the other; SIGUSR1 skips the current prompt,
SIGUSR2 lets it finish and starts no other. Runs are held at an exact forward by the gate of
``test_cli`` (never timed)."""

from __future__ import annotations

import json
import signal

from test_cli import (  # tests/ on sys.path
    EXIT_COMPLETED,
    EXIT_STOPPED,
    EXIT_USAGE,
    PROMPT,
    Held,
    png_metadata,
)

PROMPTS = [PROMPT, "Simple is", "Flat is"]


def test_text_several_prompts(run_main, zen_text, tmp_path):
    listed = tmp_path / "prompts.txt"
    listed.write_text("Simple is\n\nFlat is\n")
    code, out, err = run_main("text", "--prompt", PROMPT, "--prompts", str(listed), "--max-new-tokens", "6",
                              "--json")
    assert code == EXIT_COMPLETED, err
    report = json.loads(out)
    assert [item["prompt"] for item in report["items"]] == PROMPTS  # the empty line is no prompt
    assert report["items"][0]["text"] == zen_text(6)
    assert (report["item_reasons"], report["steps"], report["total_steps"]) == (["completed"] * 3, 18, 18)
    assert all(item["reason"] == "length" and item["steps"] == 6 for item in report["items"])


def test_text_sigusr1_skips_the_current_prompt(zen_text):
    # prompt 1 makes 5 tokens (5 forwards); forward 8 is the third token of prompt 2
    prompts = [arg for p in PROMPTS for arg in ("--prompt", p)]
    run = Held(["text", *prompts, "--max-new-tokens", "5", "--json"],
               "hold:GPT2LMHeadModel:8")
    run.wait_for("gate: holding forward 8")
    run.proc.send_signal(signal.SIGUSR1)
    run.wait_for("skipping the current prompt")
    run.release()
    code, out, err = run.finish()
    assert code == EXIT_COMPLETED, err  # a skip does not stop the sequence
    report = json.loads(out)
    assert report["item_reasons"] == ["completed", "skipped", "completed"]
    assert [item["steps"] for item in report["items"]] == [5, 3, 5]  # the token in flight, then none
    assert report["items"][0]["text"] == zen_text(5) and not report["stopped"]


def test_image_sigusr2_stops_after_the_current_prompt(tmp_path):
    out = tmp_path / "digits.png"
    run = Held(["image", "--prompt", "7", "--prompt", "3", "--steps", "6", "--out", str(out), "--json"],
               "hold:UNet2DConditionModel:2")
    run.wait_for("gate: holding forward 2")
    run.proc.send_signal(signal.SIGUSR2)
    run.wait_for("stopping once the current prompt is done")
    run.release()
    code, stdout, err = run.finish()
    report = json.loads(stdout)
    assert code == EXIT_STOPPED == report["exit_code"], err
    assert (report["reason"], report["item_reasons"], report["steps"]) == ("after_item", ["completed"], 6)
    [item] = report["items"]
    assert (item["image"], item["file"], item["steps"]) == ("complete", str(tmp_path / "digits-1.png"), 6)
    assert png_metadata(tmp_path / "digits-1.png")["prompt"] == "7"
    assert not (tmp_path / "digits-2.png").exists()  # the second prompt never started


def test_prompts_file_errors(run_main, tmp_path):
    code, _, err = run_main("text", "--prompts", str(tmp_path / "missing.txt"))
    assert code == EXIT_USAGE and "--prompts" in err and "cannot read" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, _, err = run_main("text", "--prompts", str(empty))
    assert code == EXIT_USAGE and "holds no prompt" in err
    code, _, err = run_main("image")
    assert code == EXIT_USAGE and "--prompt" in err
