"""A slow step never holds a stop: ``mode="finish", escalate_after=S`` aborts a stop that no step
boundary has seen S seconds after it was requested, keeping the last finished step's partial; in
the library and in the server (``stop_grace``). The slow step is a real layer inside the model
that stays busy until released (:mod:`tiny.slow`), so nothing here waits on a clock."""

from __future__ import annotations

import argparse
import re
import threading
from typing import Any

import httpx
import pytest
import torch

import stopcock
from stopcock.runner import RUN_OPTIONS
from stopcock.server.backends import ImageBackend
from stopcock.server.serve import configure
from stopcock.server.testing import serving, sse_data
from tiny import image as tiny
from tiny.slow import SlowLayer, slow_down

GRACE = 0.2
STEPS = 5
HELD = 2  # the denoiser call (0-based) that is held: the stop arrives during step 3


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def escalated_after(detail: str) -> float:
    found = re.search(r"escalated to abort after ([0-9.]+) s", detail)
    assert found, detail
    return float(found.group(1))


def slow_sd(hold_at: int | None = HELD) -> tuple[Any, SlowLayer]:
    pipe = tiny.stable_diffusion_pipeline()
    return pipe, slow_down(pipe.unet, "mid_block.resnets.0.conv1", SlowLayer(hold_at=hold_at))


def image_kwargs(**extra: Any) -> dict[str, Any]:
    return {"prompt": "a cat", "num_inference_steps": STEPS, "generator": torch.Generator().manual_seed(0),
            "output_type": "latent", **extra}


def stop_while_held(slow: SlowLayer, run: Any) -> stopcock.Outcome:
    """``run(signal)`` in a thread; once it is held inside the slow layer, stop the signal."""
    signal, result = stopcock.StopSignal(), {}
    worker = threading.Thread(target=lambda: result.setdefault("outcome", run(signal)))
    worker.start()
    try:
        assert slow.entered.wait(60)
        signal.stop("user")
    finally:
        worker.join(60)
        slow.release.set()  # in case the run did not escalate
        worker.join()
    return result["outcome"]


@pytest.mark.parametrize("partial", ["raw", "denoised"])
def test_a_slow_step_escalates_after_the_grace_and_keeps_the_last_step(partial):
    pipe, slow = slow_sd(hold_at=None)
    reference = stopcock.run(pipe, **image_kwargs(), stop=stopcock.max_steps(HELD), partial=partial)
    full = pipe(**image_kwargs()).images
    slow.hold_at, slow.calls = HELD, 0
    outcome = stop_while_held(
        slow,
        lambda signal: stopcock.run(
            pipe, **image_kwargs(), stop=signal, mode="finish", escalate_after=GRACE, partial=partial
        ),
    )
    assert (outcome.stopped, outcome.reason, outcome.mode, outcome.steps) == (True, "user", "abort", HELD)
    assert outcome.output is None and outcome.partial == partial
    assert f"{GRACE:g} s after the stop request" in outcome.detail
    assert escalated_after(outcome.detail) >= GRACE
    # the partial of the last finished step, as a finish-mode stop there would have decoded it
    torch.testing.assert_close(outcome.latents, reference.output.images, rtol=0, atol=0)
    slow.hold_at = None
    assert all(not m._forward_pre_hooks for c in pipe.components.values() if isinstance(c, torch.nn.Module)
               for m in c.modules())
    assert torch.equal(pipe(**image_kwargs()).images, full)  # the next run is bit-identical


def test_no_escalation_when_the_step_ends_within_the_grace():
    pipe, slow = slow_sd()

    def run(signal: stopcock.StopSignal) -> stopcock.Outcome:
        return stopcock.run(pipe, **image_kwargs(), stop=signal, mode="finish", escalate_after=60)

    signal, result = stopcock.StopSignal(), {}
    worker = threading.Thread(target=lambda: result.setdefault("outcome", run(signal)))
    worker.start()
    assert slow.entered.wait(60)
    signal.stop("user")
    slow.release.set()  # the step goes on and ends: finish takes effect at its boundary
    worker.join()
    outcome = result["outcome"]
    assert (outcome.stopped, outcome.mode, outcome.steps, outcome.detail) == (True, "finish", HELD + 1, None)
    assert outcome.output is not None


def test_a_generate_run_escalates_and_keeps_the_tokens_so_far(text_model, tokenizer):
    ids = tokenizer(["Hello world"], return_tensors="pt")
    expected = text_model.generate(**ids, max_new_tokens=8, do_sample=False)
    original = text_model.transformer.h[0].mlp
    slow = slow_down(text_model, "transformer.h.0.mlp", SlowLayer(hold_at=3))  # in the 4th token's forward
    try:
        outcome = stop_while_held(
            slow,
            lambda signal: stopcock.run(
                text_model, **ids, max_new_tokens=8, do_sample=False, stop=signal, escalate_after=GRACE
            ),
        )
    finally:
        text_model.transformer.h[0].mlp = original
    assert (outcome.stopped, outcome.mode, outcome.steps) == (True, "abort", 3)
    assert "escalated" in outcome.detail and "token ids generated so far" in outcome.detail
    assert torch.equal(outcome.output, expected[:, : ids["input_ids"].shape[1] + 3])


def test_a_timeout_escalates_too(text_model, tokenizer):
    """A timeout that expires inside a slow step is a stop request: it escalates after the grace."""
    ids = tokenizer(["Hello world"], return_tensors="pt")
    original = text_model.transformer.h[0].mlp
    slow_down(text_model, "transformer.h.0.mlp", SlowLayer(hold_at=0))  # never released
    try:
        outcome = stopcock.run(
            text_model, **ids, max_new_tokens=8, stop=stopcock.timeout(0.1), escalate_after=GRACE
        )
    finally:
        text_model.transformer.h[0].mlp = original
    assert (outcome.reason, outcome.mode, outcome.steps) == ("timeout", "abort", 0)
    assert escalated_after(outcome.detail) >= GRACE
    assert torch.equal(outcome.output, ids["input_ids"])


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"escalate_after": -1}, ValueError, "seconds >= 0"),
        ({"escalate_after": float("nan")}, ValueError, "seconds >= 0"),
        ({"escalate_after": "5"}, TypeError, "seconds"),
        ({"escalate_after": True}, TypeError, "seconds"),
        ({"escalate_after": 5, "mode": "abort"}, ValueError, "drop escalate_after"),
    ],
)
def test_bad_escalate_after_is_refused_before_the_run(text_model, tokenizer, options, error, match):
    ids = tokenizer(["Hello world"], return_tensors="pt")
    with pytest.raises(error, match=match):
        stopcock.run(text_model, **ids, max_new_tokens=2, **options)
    with pytest.raises(error, match=match):  # streams pass it through, checked in the caller's thread
        stopcock.stream(text_model, **ids, max_new_tokens=2, tokenizer=tokenizer, **options)
    assert "escalate_after" in RUN_OPTIONS


# -- the server ---------------------------------------------------------------------------------------
def test_the_server_escalates_a_stop_held_by_a_slow_step_and_returns_the_partial_image():
    pipe, slow = slow_sd()
    backend = ImageBackend(pipe, "slow-sd")
    body = {"kind": "image", "prompt": "a cat", "parameters": {"steps": STEPS, "seed": 3, "previews": False}}
    with (
        serving({"image": backend}, stop_grace=GRACE) as (url, _),
        httpx.Client(base_url=url, timeout=60) as client,
    ):
        job = client.post("/v1/jobs", json=body).json()
        assert slow.entered.wait(60)
        stopped = client.post(f"/v1/jobs/{job['id']}/stop").json()
        assert (stopped["state"], stopped["reason"], stopped["step"]) == ("stopped", "user", HELD)
        assert stopped["outcome"]["mode"] == "abort" and "escalated" in stopped["outcome"]["detail"]
        image = client.get(f"/v1/jobs/{job['id']}/result").json()["result"]["image"]
        # the same seed stopped by the step count at that step, decoded by the pipeline itself
        reference = client.post("/v1/jobs", json={**body, "stop": {"max_steps": HELD}}).json()
        with client.stream("GET", f"/v1/jobs/{reference['id']}/events") as response:
            done = next(e for e in sse_data(response.iter_lines()) if e["type"] == "done")
        assert (done["reason"], done["step"], done["outcome"]["mode"]) == ("max_steps", HELD, "finish")
        assert client.get(f"/v1/jobs/{reference['id']}/result").json()["result"]["image"] == image
    slow.release.set()


def test_stop_grace_is_an_option_of_serve():
    parser = configure(argparse.ArgumentParser())
    assert parser.parse_args([]).stop_grace == 5.0
    assert parser.parse_args(["--stop-grace", "0.5"]).stop_grace == 0.5
    for bad in ("-1", "nan", "soon"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--stop-grace", bad])
