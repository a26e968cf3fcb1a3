"""``stopcock text --tp N``: the text model sharded over local ranks (gloo, CPU, one torch thread each).

Each test runs the real command in a subprocess (rank 0), which starts the other rank itself; every
launch is bounded (a hang fails the test). The sharded output must be the unsharded one, a stop
(a condition, a clock, Ctrl+C) must end every rank at the same token (rank 0 compares each rank's
report of its end with its own and says it on stderr), and a killed rank must end the other with a
clear error.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import ACK_ONCE, Held  # tests/ is on sys.path under pytest

LAUNCH = 300  # seconds for one command, both ranks: a hang fails the test
PROMPT = "Once upon a time"
TOKENS = 12


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (4 heads, 2 key-value heads: shardable over 2 ranks) with the demo tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from stopcock.tiny.demo import demo_model

    tokenizer = AutoTokenizer.from_pretrained(demo_model("text"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
    )
    folder = tmp_path_factory.mktemp("tiny-llama-tp")
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _stopcock(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stopcock", "text", *args], capture_output=True, text=True,
                          env=_env(), timeout=LAUNCH, stdin=subprocess.DEVNULL)


def _json(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.stdout.strip(), done.stderr
    return json.loads(done.stdout)


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _exits_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` (not a child of this one) exits within ``seconds``: its pidfd becomes
    readable when it does."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ready, _, _ = select.select([fd], [], [], seconds)
        return bool(ready)
    finally:
        os.close(fd)


@pytest.mark.timeout(3 * LAUNCH)
def test_the_sharded_command_prints_what_one_process_prints(llama_dir: Path):
    common = ["--model", str(llama_dir), "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--json"]
    one, two = _stopcock(*common), _stopcock(*common, "--tp", "2")
    assert (one.returncode, two.returncode) == (0, 0), two.stderr
    plain, sharded = _json(one), _json(two)
    assert (sharded["text"], sharded["steps"], sharded["reason"]) == (plain["text"], TOKENS, "length")
    assert sharded["threads"] == 1  # one torch thread per rank
    assert f"every rank ended at the same token: run 1 at token {TOKENS} (length)" in two.stderr


@pytest.mark.timeout(4 * LAUNCH)
def test_a_stop_of_rank_0_ends_every_rank_at_the_same_token(llama_dir: Path):
    common = ["--model", str(llama_dir), "--prompt", PROMPT, "--max-new-tokens", str(TOKENS), "--json"]
    # --max-steps 3 is decided at token 3 on rank 0 and announced for token 4: every rank stops there
    stopped = _stopcock(*common, "--tp", "2", "--max-steps", "3")
    assert stopped.returncode == 3, stopped.stderr
    got = _json(stopped)
    assert (got["stopped"], got["reason"], got["steps"]) == (True, "max_steps", 4)
    assert "every rank ended at the same token: run 1 at token 4 (max_steps)" in stopped.stderr
    four = _json(_stopcock(*common[:-3], "--max-new-tokens", "4", "--json"))
    assert got["text"] == four["text"]  # the partial result is the unsharded one's first 4 tokens

    # two prompts: two runs of the group, one after the other
    timed = _stopcock(*common, "--tp", "2", "--timeout", "0", "--prompt", "The quick brown fox")
    assert timed.returncode in (0, 3), timed.stderr
    items = _json(timed)["items"]  # rank 0's clock: expired at the first check of each prompt's run
    assert [item["reason"] for item in items] == ["timeout", "timeout"]
    ends = ", ".join(f"run {n} at token {item['steps']} (timeout)" for n, item in enumerate(items, 1))
    assert f"every rank ended at the same token: {ends}" in timed.stderr
    assert all(1 <= item["steps"] < TOKENS for item in items)


@pytest.mark.timeout(2 * LAUNCH)
def test_ctrl_c_on_rank_0_stops_every_rank_at_the_same_token(llama_dir: Path):
    args = ["text", "--model", str(llama_dir), "--prompt", PROMPT, "--max-new-tokens", "40", "--tp", "2"]
    held = Held(args, gate="hold:LlamaForCausalLM:4")  # rank 0 holds before its forward of token 4
    held.wait_for("gate: holding")
    held.interrupt()
    held.wait_for(ACK_ONCE)
    held.release()
    code, _, err = held.finish()
    # stopped inside token 4 on rank 0: the boundary after it announces token 5, where every rank stops
    assert code == 130, err
    assert "stopcock: stopped (interrupted) after 5 of 40 tokens" in err
    assert "every rank ended at the same token: run 1 at token 5 (interrupted)" in err


@pytest.mark.timeout(2 * LAUNCH)
def test_a_killed_rank_ends_the_other_with_a_clear_error(llama_dir: Path):
    args = ["text", "--model", str(llama_dir), "--prompt", PROMPT, "--max-new-tokens", "40", "--tp", "2"]
    held = Held(args, gate="hold:LlamaForCausalLM:4")
    held.wait_for("gate: holding")
    (worker,) = _children(held.proc.pid)
    os.kill(worker, signal.SIGKILL)  # rank 1, waiting in its collective of token 4
    assert _exits_within(worker, 60)
    held.release()  # rank 0's next collective meets a closed connection
    code, _, err = held.finish()
    assert code == 1, err
    assert "stopcock: error: --tp 2: rank 0: a collective of the run failed, a rank of the group has" in err
    assert "restarted" in err and "Traceback" not in err


@pytest.mark.timeout(2 * LAUNCH)
def test_a_killed_rank_0_ends_the_other(llama_dir: Path):
    args = ["text", "--model", str(llama_dir), "--prompt", PROMPT, "--max-new-tokens", "40", "--tp", "2"]
    held = Held(args, gate="hold:LlamaForCausalLM:4")
    held.wait_for("gate: holding")
    (worker,) = _children(held.proc.pid)
    held.proc.kill()  # rank 0, which holds the group's store
    held.proc.wait()
    assert _exits_within(worker, LAUNCH)  # its collective fails on the closed connection: it leaves
    held.watchdog.cancel()
    assert held.proc.stderr is not None
    err = "".join(held.stderr) + held.proc.stderr.read().decode()
    assert "stopcock: rank 1: error:" in err and "has died" in err


def test_options_the_ranks_cannot_agree_on_name_the_fix(llama_dir: Path, text_model_dir: Path, run_main):
    base = ["text", "--model", str(llama_dir), "--prompt", PROMPT]
    code, _, err = run_main(*base, "--tp", "2", "--stop", "x")
    assert code == 2 and "--stop ends the text row by row" in err and "drop it with --tp" in err
    code, _, err = run_main(*base, "--tp", "3")
    assert code == 1 and "4 attention heads, which do not split over 3 ranks" in err
    code, _, err = run_main("text", "--model", str(text_model_dir), "--prompt", PROMPT, "--tp", "2")
    assert code == 1 and "GPT2LMHeadModel has no tensor-parallel plan" in err and "without --tp" in err


@pytest.mark.timeout(2 * LAUNCH)
def test_ctrl_c_twice_abandons_the_run_and_ends_the_other_rank(llama_dir: Path):
    args = ["text", "--model", str(llama_dir), "--prompt", PROMPT, "--max-new-tokens", "40", "--tp", "2"]
    held = Held(args, gate="hold:LlamaForCausalLM:4")
    held.wait_for("gate: holding")
    (worker,) = _children(held.proc.pid)
    held.interrupt()
    held.wait_for(ACK_ONCE)
    held.interrupt()  # rank 0 leaves inside token 4; rank 1 waits in its collective: it is ended
    code, _, err = held.finish()
    assert code == 130, err
    assert "stopcock: stopped (interrupted) after 3 of 40 tokens" in err and "mode abort" in err
    assert _exits_within(worker, 0)  # ended before the command returned
    assert "every rank ended" not in err and "Traceback" not in err
