"""A stop agreed across ranks: 2 (and 3) processes on gloo (CPU, one torch thread each), a tiny Llama sharded
with ``tp_plan="auto"`` and a hand-sharded diffusers loop. Every rank must return, stopped at the same
step with the same reason and output, whichever rank (or thread, or clock) decided; a killed rank
must end the other with a clear error. Each launch is bounded by a subprocess timeout: a hang fails.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import stopcock
from stopcock.conditions import as_condition
from stopcock.ranks import Agreement, RanksError, agreement, group_of

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("ranks_worker.py")
STOP_AT = 3  # the token at which a rank's own stop fires (ranks_worker.STOP_AT)
NEW_TOKENS = 24
LAUNCH_TIMEOUT = 300  # seconds for a whole launch: a hang fails the test instead of stalling it


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved to a folder (4 heads, 2 key-value heads: shardable over 2 ranks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return {
        **os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def _finish(procs: list[subprocess.Popen[bytes]]) -> list[int]:
    """Wait for every process within the launch's bound; on a hang kill them all and fail."""
    codes = []
    try:
        for p in procs:
            codes.append(p.wait(timeout=LAUNCH_TIMEOUT))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        pytest.fail(f"a rank did not return within {LAUNCH_TIMEOUT} s: a hang")
    return codes


def _launch(
    scenarios: list[str], model_dir: Path, out: Path, *, world: int = 2, group_timeout: float = 60
) -> list[int]:
    """The ranks as torchrun starts them (its environment), one process each, without its agent
    (which would end the others when one rank dies)."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), ",".join(scenarios), str(model_dir), str(out)],
            env={
                **_env(), "RANKS_TEST_GROUP_TIMEOUT": str(group_timeout),
                "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            },
        )
        for r in range(world)
    ]
    return _finish(procs)


def _results(out: Path, scenario: str, world: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out / f"{scenario}.rank{r}.json").read_text()) for r in range(world)]


def _agreed(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The one result every rank returned (they must be equal), for the checks that follow."""
    first = results[0]
    assert all(r == first for r in results), results
    return first


TEXT = [
    "text-none", "text-rank0", "text-rank1", "text-rank0-abort", "text-timeout", "text-thread", "text-wait",
    "text-wait-abort",
]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_tp_llama_under_torchrun_stops_every_rank_at_the_same_token(llama_dir: Path, tmp_path: Path):
    port = _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}"]
    args = [str(WORKER), ",".join(TEXT), str(llama_dir), str(tmp_path)]
    proc = subprocess.Popen([*torchrun, *args], env=_env())
    assert _finish([proc]) == [0]

    full = _agreed(_results(tmp_path, "text-none"))
    assert (full["stopped"], full["reason"], full["steps"]) == (False, "length", NEW_TOKENS)
    prompt = 4
    for scenario in ("text-rank0", "text-rank1"):
        got = _agreed(_results(tmp_path, scenario))
        # the deciding rank announces the step after the one it decided at; every rank stops there
        assert (got["stopped"], got["reason"], got["mode"]) == (True, "user", "finish")
        assert got["steps"] == STOP_AT + 1
        assert got["tokens"][0] == full["tokens"][0][: prompt + STOP_AT + 1]  # the partial result
    aborted = _agreed(_results(tmp_path, "text-rank0-abort"))
    assert (aborted["stopped"], aborted["mode"], aborted["steps"]) == (True, "abort", STOP_AT + 1)
    assert aborted["tokens"][0] == full["tokens"][0][: prompt + STOP_AT + 1]
    timed = _agreed(_results(tmp_path, "text-timeout"))  # a clock of rank 1 only
    assert (timed["stopped"], timed["reason"]) == (True, "timeout")
    assert 1 <= timed["steps"] < NEW_TOKENS
    for scenario, mode in (("text-wait", "finish"), ("text-wait-abort", "abort")):
        # no on_step: no step was checked until rank 0's stop inside its forward of token 4; the
        # boundary after it announced token 5, and rank 1's watcher armed rank 1's check for it
        waited = _agreed(_results(tmp_path, scenario))
        assert (waited["stopped"], waited["reason"], waited["mode"]) == (True, "user", mode)
        assert waited["steps"] == STOP_AT + 2
        assert waited["tokens"][0] == full["tokens"][0][: prompt + STOP_AT + 2]
    threaded = _agreed(_results(tmp_path, "text-thread"))
    assert (threaded["stopped"], threaded["reason"]) == (True, "from-thread")
    assert STOP_AT < threaded["steps"] < NEW_TOKENS
    assert threaded["tokens"][0] == full["tokens"][0][: prompt + threaded["steps"]]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_stop_latency_counts_on_each_rank_from_when_it_knew_of_the_stop(llama_dir: Path, tmp_path: Path):
    # rank 1 stops its signal in its on_step of token 3 and announces token 4; rank 0 has no stop
    assert _launch(["text-rank1"], llama_dir, tmp_path) == [0, 0]
    assert _agreed(_results(tmp_path, "text-rank1"))["steps"] == STOP_AT + 1
    other, decider = (json.loads((tmp_path / f"text-rank1.rank{r}.clock.json").read_text()) for r in range(2))
    for clock in (other, decider):
        assert clock["stop_latency"] is not None and clock["stop_latency"] >= 0

    def knew(clock: dict[str, Any]) -> float:
        """When the latency starts, on that rank's clock (seconds from its run's start)."""
        return float(clock["elapsed"] - clock["stop_latency"])

    def boundary(clock: dict[str, Any], step: int) -> float:
        return float(clock["steps"][str(step)])

    # the decider: from its request, in its on_step of token 3, not from the agreed step's check
    assert boundary(decider, STOP_AT) <= knew(decider) < boundary(decider, STOP_AT + 1)
    # the other rank: from when its watcher read the announcement. Not before its boundary of token
    # 2 (rank 1 decided after both ranks had met in the forward of token 3), not at the agreed
    # step's check: before its boundary of token 4 (rank 1 began the forward of token 4, where
    # rank 0 waits for it, only once rank 0 had acknowledged the announcement)
    assert boundary(other, STOP_AT - 1) < knew(other) < boundary(other, STOP_AT + 1)


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("dies", [1, 0])  # rank 0 holds the group's store
def test_a_killed_rank_ends_the_other_with_a_clear_error(llama_dir: Path, tmp_path: Path, dies: int):
    scenario = "text-kill" if dies == 1 else "text-kill0"
    codes = _launch([scenario], llama_dir, tmp_path)
    assert codes[dies] == 7 and codes[1 - dies] == 0  # one died at token 3; the other returned
    survivor = json.loads((tmp_path / f"{scenario}.rank{1 - dies}.json").read_text())
    assert survivor["error"] == "RankLost"
    assert "died" in survivor["message"] and "restarted" in survivor["message"]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_a_rank_left_out_of_the_agreement_ends_the_announcer_with_an_error(llama_dir: Path, tmp_path: Path):
    # rank 1 runs with group=False: rank 0's stop is never acknowledged; the group's timeout bounds it
    codes = _launch(["text-unagreed"], llama_dir, tmp_path, group_timeout=10)
    assert codes[0] == 0  # rank 0 returned with its error (rank 1 then fails in its next collective)
    announcer = json.loads((tmp_path / "text-unagreed.rank0.json").read_text())
    assert announcer["error"] == "RankLost"
    assert "group=" in announcer["message"]


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_a_hand_sharded_diffusers_loop_stops_every_rank_at_the_same_step(tmp_path: Path):
    # diffusers' own context parallelism cannot be enabled on a CPU-only torch (see ranks_worker.py):
    # the UNet all-reduces its output each step instead, given group= or carrying diffusers' config
    assert _launch(["image-rank1", "image-detected"], tmp_path, tmp_path) == [0, 0]
    given = _agreed(_results(tmp_path, "image-rank1"))
    assert (given["stopped"], given["reason"], given["steps"]) == (True, "user", 3)
    assert _agreed(_results(tmp_path, "image-detected")) == given


@pytest.mark.timeout(LAUNCH_TIMEOUT + 60)
def test_three_ranks_stop_at_the_same_step(tmp_path: Path):
    # rank 1 announces; it waits for the acknowledgements of ranks 0 and 2
    assert _launch(["image-rank1"], tmp_path, tmp_path, world=3) == [0, 0, 0]
    got = _agreed(_results(tmp_path, "image-rank1", world=3))
    assert (got["stopped"], got["reason"], got["steps"]) == (True, "user", 3)


# -- in one process: a group of one rank ---------------------------------------------------------


@pytest.fixture
def one_rank_group():
    """torch.distributed initialised in this process as a group of one rank (torn down after)."""
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=10))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_nothing_is_detected_without_a_process_group(text_model):
    assert not dist.is_initialized()
    assert group_of(text_model) is None
    assert agreement(text_model, None, None) is None


@pytest.mark.timeout(120)
def test_a_one_rank_group_agrees_with_itself(one_rank_group, text_model, tokenizer):
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    signal = stopcock.StopSignal()

    def on_step(state: stopcock.StepState) -> None:
        if state.step == 2:
            signal.stop("user")

    outcome = stopcock.run(
        text_model, ids, stop=signal, on_step=on_step, group=one_rank_group, max_new_tokens=10,
        do_sample=False,
    )
    # decided at token 2, announced for token 3, stopped there
    assert (outcome.stopped, outcome.reason, outcome.steps) == (True, "user", 3)
    assert outcome.output.shape[1] == ids.shape[1] + 3
    # the run's end closed its key and waited for its watcher thread to leave
    assert not [t for t in threading.enumerate() if t.name == "stopcock-ranks"]
    assert group_of(text_model) is None  # a model that is not sharded: no agreement by itself
    unsharded = stopcock.run(text_model, ids, stop=stopcock.max_steps(2), max_new_tokens=10, do_sample=False)
    assert unsharded.steps == 2


@pytest.mark.timeout(120)
def test_a_group_runs_stop_latency_counts_from_the_request_not_from_the_agreed_step(
    one_rank_group, text_model, tokenizer
):
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    signal = stopcock.StopSignal()
    boundaries: dict[int, float] = {}

    def on_step(state: stopcock.StepState) -> None:
        boundaries[state.step] = state.elapsed
        if state.step == 2:
            signal.stop("user")

    outcome = stopcock.run(
        text_model, ids, stop=signal, on_step=on_step, group=one_rank_group, max_new_tokens=10,
        do_sample=False,
    )
    assert (outcome.stopped, outcome.steps) == (True, 3)
    assert outcome.stop_latency is not None and outcome.stop_latency >= 0
    requested = outcome.elapsed - outcome.stop_latency  # on the run's clock, from its start
    # the stop in on_step at token 2, not the check at the agreed token 3, where the run's token stopped
    assert boundaries[2] <= requested < boundaries[3]


@pytest.mark.timeout(120)
def test_a_stream_over_a_one_rank_group_stops_at_the_agreed_step(one_rank_group, text_model, tokenizer):
    from torch.distributed.device_mesh import init_device_mesh

    ids = tokenizer("Hello", return_tensors="pt").input_ids
    mesh = init_device_mesh("cpu", (1,))  # a mesh of one rank: nothing to agree with
    assert agreement(text_model, None, mesh) is None
    with stopcock.stream(
        text_model, ids, tokenizer=tokenizer, group=one_rank_group, max_new_tokens=20, do_sample=False,
        buffer=1,  # the run waits for the consumer: it is at most a few tokens ahead of it
    ) as events:
        for event in events:
            if isinstance(event, stopcock.TextChunk) and event.step >= 2:
                events.stop()  # seen at token 2 at the earliest: announced for a later token
            if isinstance(event, stopcock.Done):
                outcome = event.outcome
    assert (outcome.stopped, outcome.reason) == (True, "user")
    assert 3 <= outcome.steps < 20  # the agreed step, before the end


def test_a_group_run_checks_no_step_until_a_stop_is_possible(one_rank_group):
    from stopcock.control import RunControl

    signal = stopcock.StopSignal()
    control = RunControl(Agreement(as_condition(signal), one_rank_group))
    # no step check until a stop is possible: transformers' criterion stays out of generate's loop
    assert control.steps_wait and control.quiet_step(1)
    signal.stop("user")  # a stop of this rank's own: the next boundary checks (and announces)
    assert not control.quiet_step(2)
    with pytest.raises(ValueError, match="stop_strings="):
        agreement(None, stopcock.stop_strings(["\n"]), one_rank_group)


def test_a_group_run_needs_torch_distributed_initialised(text_model):
    with pytest.raises(RanksError, match="init_process_group"):
        stopcock.run(text_model, torch.tensor([[1, 2]]), group=object(), max_new_tokens=2)


def test_group_runs_refuse_escalate_after(one_rank_group, text_model):
    with pytest.raises(ValueError, match="drop it"):
        stopcock.run(
            text_model, torch.tensor([[1, 2]]), stop=stopcock.StopSignal(), group=one_rank_group,
            escalate_after=1.0, max_new_tokens=2,
        )


def test_a_rank_that_sees_an_announcement_it_already_passed_raises(one_rank_group):
    agreed = Agreement(None, one_rank_group)
    state = stopcock.StepState
    store = dist.distributed_c10d._get_default_store()
    with agreed.guard():
        assert agreed.check(state(step=4)) is None
        # as a rank out of lockstep would have announced, for a step this one has passed
        store.compare_set(f"{agreed.key}/stop", "", "3 user")
        store.wait([f"{agreed.key}/ack/0"])  # this rank's watcher has the announcement
        with pytest.raises(RanksError, match="lockstep"):
            agreed.check(state(step=5))
