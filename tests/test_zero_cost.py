"""Zero cost until stopped: nothing is installed in a model until a stop becomes possible, a step
builds no state while nothing can fire, arming is safe while the run's thread is inside a forward,
and once armed an abort lands at the next module call, with the next run bit-identical."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module
from transformers import StoppingCriteriaList, pipeline

import stopcock
from stopcock.conditions import Condition
from stopcock.control import RunControl
from stopcock.hooks import Tripwire
from stopcock.hooks import _serialised as serialised
from tiny import image as tiny
from tiny.slow import SlowLayer, slow_down

NEW = 12


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def hooked(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if m._forward_pre_hooks]


def global_hooks() -> int:
    """The hooks in torch's global pre-hook dict, where abort mode's check goes once armed."""
    return len(torch_module._global_forward_pre_hooks)


def spied(monkeypatch, owner: type, name: str, note: Any) -> list[Any]:
    """``owner.name`` watched for the test: each call first appends ``note(self, *args)`` to the list
    returned, then runs as it would."""
    seen: list[Any] = []
    real = getattr(owner, name)

    def spy(self, *args, **kwargs):
        seen.append(note(self, *args))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return seen


@pytest.fixture
def states(monkeypatch):
    """One entry for each StepState runs build."""
    return spied(monkeypatch, RunControl, "state", lambda control: control.steps)


# -- the tripwire ------------------------------------------------------------------------------------
def test_a_tripwire_installs_nothing_until_armed_and_puts_the_users_dicts_back():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    theirs = model[1].register_forward_pre_hook(lambda m, a: None)
    original = model[1]._forward_pre_hooks
    seen: list[nn.Module] = []
    with Tripwire(model.modules(), seen.append) as wire:
        model(torch.zeros(1, 2))
        assert seen == [] and hooked(model) == [model[1]]
        wire.arm()
        wire.arm()  # idempotent
        model(torch.zeros(1, 2))
        assert seen == [model, model[0], model[1], model[2]]
        assert model[1]._forward_pre_hooks is not original and len(original) == 1  # a copy was published
    assert model[1]._forward_pre_hooks is original  # the dict the user's handle refers to
    theirs.remove()
    assert hooked(model) == []
    wire.arm()  # closed: nothing is installed any more
    assert hooked(model) == []


@pytest.mark.parametrize("every_module", [False, True], ids=["its modules", "every module"])
def test_arming_from_another_thread_mutates_no_dict_torch_may_be_iterating(every_module):
    """The run's thread is inside a forward (held in ``first``) when another thread arms: the dicts
    torch already read stay untouched, and the next module call runs the check."""
    first = SlowLayer(hold_at=0)
    model = nn.Sequential(first, nn.Linear(2, 2), nn.Linear(2, 2))
    read_by_torch = [m._forward_pre_hooks for m in model.modules()] + [torch_module._global_forward_pre_hooks]
    seen: list[nn.Module] = []

    def check(module: nn.Module) -> None:
        seen.append(module)
        first.release.set()  # the check ran inside the held forward: let it go on

    with Tripwire(None if every_module else model.modules(), check) as wire:

        def arm_while_inside() -> None:
            assert first.entered.wait(30)
            wire.arm()

        helper = threading.Thread(target=arm_while_inside)
        helper.start()
        model(torch.zeros(1, 2))
        helper.join()
    assert all(d == {} for d in read_by_torch)  # never mutated
    assert model not in seen and first not in seen  # already past their pre-hooks when armed
    assert first.inner in seen and seen[-2:] == [model[1], model[2]]
    assert hooked(model) == [] and global_hooks() == 0
    assert torch_module._global_forward_pre_hooks is read_by_torch[-1]  # torch's own dict is back


def test_tripwires_sharing_a_module_and_a_hook_registered_while_armed():
    layer, x = nn.Linear(2, 2), torch.zeros(1, 2)
    original = layer._forward_pre_hooks
    a_seen: list[nn.Module] = []
    b_seen: list[nn.Module] = []
    with Tripwire([layer], a_seen.append) as a, Tripwire([layer], b_seen.append) as b:
        a.arm()
        b.arm()
        layer(x)
        a.close()
        layer(x)
    assert (len(a_seen), len(b_seen)) == (1, 2)
    assert layer._forward_pre_hooks is original and not original

    late_calls: list[int] = []
    with Tripwire([layer], a_seen.append) as c:
        c.arm()
        late = layer.register_forward_pre_hook(lambda m, a: late_calls.append(1))
    layer(x)  # the late hook survived the close; the tripwire's check did not
    assert late_calls == [1] and len(a_seen) == 1
    late.remove()
    assert not layer._forward_pre_hooks


class Reentrant(nn.Linear):
    """A layer whose hash, taken inside arming and removal, runs ``then`` once: a stop re-entering
    them on the same thread, as a signal handler or a stream's garbage-collected finaliser can."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.then: Any = None

    def __hash__(self) -> int:
        then, self.then = self.then, None
        if then is not None:
            then()
        return id(self)


def test_arming_re_entered_on_its_own_thread_stays_consistent():
    layer, other, x = Reentrant(), nn.Linear(2, 2), torch.zeros(1, 2)
    originals = layer._forward_pre_hooks, other._forward_pre_hooks
    first: list[nn.Module] = []
    second: list[nn.Module] = []
    with Tripwire([layer], first.append) as one, Tripwire([layer, other], second.append) as two:
        layer.then = two.arm  # re-entered inside one's arming
        one.arm()
        layer(x)
        other(x)
        assert (first, second) == ([layer], [layer, other])
    assert layer._forward_pre_hooks is originals[0] and other._forward_pre_hooks is originals[1]
    assert not hooked(layer) and not hooked(other)


def test_an_operation_re_entered_during_another_runs_after_it():
    done: list[str] = []

    def outer() -> None:
        done.append("outer starts")
        serialised(lambda: done.append("inner"))  # as a signal handler would, on this thread
        done.append("outer ends")

    serialised(outer)
    assert done == ["outer starts", "outer ends", "inner"]


# -- the step fast path --------------------------------------------------------------------------------
def test_quiet_steps_build_no_state_until_something_can_fire(states):
    signal = stopcock.StopSignal()
    with RunControl(signal | stopcock.timeout(3600) | stopcock.max_steps(5)) as control:
        assert [control.quiet_step(n) for n in (1, 2, 3, 4)] == [True] * 4
        assert not control.check() and states == [] and control.steps == 4
        assert not control.quiet_step(5) and control.steps == 4  # max_steps may fire: the full step
        assert control.step(5) and len(states) == 1
    with RunControl(signal) as control:
        assert control.quiet_step(1)
        signal.stop("now")
        assert not control.quiet_step(2) and control.step(2) and control.token.reason == "now"


@pytest.mark.parametrize(
    "stop, on_step",
    [(stopcock.when(lambda s: False), None), (stopcock.StopSignal(), print), (stopcock.timeout(0), None)],
    ids=["when", "on_step", "expired"],
)
def test_steps_that_something_watches_are_full_steps(stop, on_step):
    with RunControl(stop, on_step=on_step) as control:
        assert not control.quiet_step(1)


@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_a_generate_run_builds_no_state_per_token(text_model, tokenizer, states, mode):
    ids = tokenizer(["Hello world"], return_tensors="pt")
    signal = stopcock.StopSignal()
    outcome = stopcock.run(text_model, **ids, max_new_tokens=NEW, do_sample=False, stop=signal, mode=mode)
    assert outcome.steps == NEW and not outcome.stopped and states == []


def test_a_diffusers_run_builds_no_state_per_step_and_keeps_the_last_latents(states):
    pipe = tiny.stable_diffusion_pipeline()
    kwargs = {"prompt": "a cat", "num_inference_steps": 4, "output_type": "latent"}
    seen: list[object] = []
    watched = stopcock.run(pipe, **kwargs, generator=torch.Generator().manual_seed(0), on_step=seen.append)
    states.clear()
    signal = stopcock.StopSignal()
    quiet = stopcock.run(pipe, **kwargs, generator=torch.Generator().manual_seed(0), stop=signal)
    assert quiet.steps == 4 and states == []
    # what the fast path left to read later is what a watched run saw at its last step
    torch.testing.assert_close(quiet.latents, watched.latents, rtol=0, atol=0)
    torch.testing.assert_close(quiet.extra["denoised"], watched.extra["denoised"], rtol=0, atol=0)


def test_a_quiet_diffusers_run_hooks_nothing_into_its_models():
    pipe = tiny.stable_diffusion_pipeline()
    models = [pipe.unet, pipe.vae, pipe.text_encoder]
    seen: list[int] = []

    def count_hooks(module: nn.Module, args: Any) -> None:
        seen.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in models))

    handle = pipe.unet.conv_in.register_forward_pre_hook(count_hooks)  # inside each UNet forward
    try:
        outcome = stopcock.run(pipe, **sd_kwargs(3), stop=stopcock.StopSignal())
    finally:
        handle.remove()
    assert outcome.steps == 3 and seen == [0, 0, 0]
    assert all("_call_impl" not in vars(m) for m in models)


@pytest.fixture
def boundaries(monkeypatch):
    """The step counts at which runs made a step check (``RunControl.quiet_step``)."""
    return spied(monkeypatch, RunControl, "quiet_step", lambda control, steps: steps)


def sd_kwargs(steps: int = 6) -> dict[str, Any]:
    return {"prompt": "a cat", "num_inference_steps": steps, "output_type": "latent",
            "generator": torch.Generator().manual_seed(0)}


def test_a_diffusers_step_is_only_counted_until_another_thread_stops(boundaries):
    pipe = tiny.stable_diffusion_pipeline()
    expected = stopcock.run(pipe, **sd_kwargs(), stop=stopcock.max_steps(3))  # max_steps: checked every step
    boundaries.clear()
    signal, entered, release, calls = stopcock.StopSignal(), threading.Event(), threading.Event(), []

    def hold_third(module, args):  # holds the UNet's forward of step 3 until the other thread has stopped
        calls.append(1)
        if len(calls) == 3:
            entered.set()
            release.wait(timeout=60)

    def stop_while_held() -> None:
        entered.wait()
        signal.stop("elsewhere")
        release.set()

    handle = pipe.unet.register_forward_pre_hook(hold_third)
    thread = threading.Thread(target=stop_while_held)
    thread.start()
    try:
        outcome = stopcock.run(pipe, **sd_kwargs(), stop=signal)
    finally:
        handle.remove()
        release.set()
        thread.join()
    # step 1 (where the loop is found) and step 3 (armed by the stop) are checked; step 2 only counted
    assert boundaries == [1, 3]
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.total_steps) == (True, "elsewhere", 3, 6)
    assert outcome.extra.get("path") == expected.extra.get("path") and outcome.partial == expected.partial
    torch.testing.assert_close(outcome.latents, expected.latents, rtol=0, atol=0)


def test_a_skip_arms_the_diffusers_step_check(boundaries):
    pipe = tiny.stable_diffusion_pipeline()
    signal, calls = stopcock.StopSignal(), []

    def skip_in_third(module, args, output):
        calls.append(1)
        if len(calls) == 3:
            signal.skip()

    handle = pipe.unet.register_forward_hook(skip_in_third)
    try:
        outcome = stopcock.run(pipe, **sd_kwargs(), stop=signal)
    finally:
        handle.remove()
    assert boundaries == [1, 3] and (outcome.reason, outcome.steps) == ("skipped", 3)


def test_a_timeout_arms_the_diffusers_step_check_shortly_before_it_expires(boundaries):
    pipe = tiny.stable_diffusion_pipeline()
    handle = pipe.unet.register_forward_pre_hook(lambda module, args: time.sleep(0.25))  # 0.25 s a step
    try:
        outcome = stopcock.run(pipe, **sd_kwargs(), stop=stopcock.timeout(1.0))
    finally:
        handle.remove()
    assert (outcome.stopped, outcome.reason) == (True, "timeout") and outcome.steps < 6
    # step 2 ends at about 0.5 s, long before the check is armed (ARM_AHEAD before 1 s); the last is checked
    assert boundaries[0] == 1 and 2 not in boundaries and boundaries[-1] == outcome.steps


@pytest.mark.parametrize(
    "stop", [stopcock.max_steps(100), stopcock.when(lambda state: False)], ids=["max_steps", "when"]
)
def test_what_must_see_every_diffusers_step_checks_every_step(boundaries, stop):
    stopcock.run(tiny.stable_diffusion_pipeline(), **sd_kwargs(4), stop=stop)
    assert boundaries == [1, 2, 3, 4]


# -- finish mode: the criterion joins generate's loop only when a stop becomes possible -----------------
OURS = "_RunCriteria"


@pytest.fixture
def checks(monkeypatch):
    """For each check generate makes of its criteria list, the names of the criteria in it."""
    def names(criteria: StoppingCriteriaList, *_: Any) -> list[str]:
        return [type(c).__name__ for c in criteria]

    return spied(monkeypatch, StoppingCriteriaList, "__call__", names)


@pytest.fixture
def hold(text_model):
    """``hold()`` puts a layer in the tiny GPT-2 that holds the forward of token 4 (the prefill
    makes token 1) and returns it; the model is itself again after the test."""
    original = text_model.transformer.h[1].mlp
    layers: list[SlowLayer] = []

    def install() -> SlowLayer:
        layers.append(slow_down(text_model, "transformer.h.1.mlp", SlowLayer(hold_at=3)))
        return layers[-1]

    yield install
    for layer in layers:
        layer.release.set()
    text_model.transformer.h[1].mlp = original


@pytest.mark.parametrize("target", ["generate", "pipeline"])
def test_finish_mode_joins_the_loop_when_another_thread_stops(text_model, tokenizer, checks, hold, target):
    ids = tokenizer(["Hello world"], return_tensors="pt")
    expected = text_model.generate(**ids, max_new_tokens=NEW, do_sample=False)
    checks.clear()
    held = hold()
    signal = stopcock.StopSignal()

    def stop_while_held() -> None:
        held.entered.wait()
        signal.stop("elsewhere")
        held.release.set()

    thread = threading.Thread(target=stop_while_held)
    thread.start()
    if target == "generate":
        outcome = stopcock.run(text_model, **ids, max_new_tokens=NEW, do_sample=False, stop=signal)
        assert torch.equal(outcome.output, expected[:, : ids["input_ids"].shape[1] + 4])
    else:
        pipe = pipeline("text-generation", model=text_model, tokenizer=tokenizer)
        outcome = stopcock.run(pipe, "Hello world", max_new_tokens=NEW, do_sample=False, stop=signal)
        text = tokenizer.decode(expected[0, : ids["input_ids"].shape[1] + 4])
        assert outcome.output[0]["generated_text"] == text
    thread.join()
    # out of the loop for tokens 1 to 3; in it from the stop on, which ends the call after token 4
    assert [OURS in names for names in checks] == [False, False, False, True]
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.mode) == (True, "elsewhere", 4, "finish")
    assert outcome.row_reasons == ["elsewhere"]


def test_a_skip_arms_the_criterion_for_the_rest_of_the_run(text_model, tokenizer, checks):
    pipe = pipeline("text-generation", model=text_model, tokenizer=tokenizer)
    signal, forwards = stopcock.StopSignal(), []

    def count(module, args, output):
        forwards.append(1)
        if len(forwards) == 3:  # the forward of the first item's token 3
            signal.skip()

    handle = text_model.register_forward_hook(count)
    try:
        outcome = stopcock.run(
            pipe, ["Hello world", "Stop the pipeline"], max_new_tokens=NEW, do_sample=False, stop=signal
        )
    finally:
        handle.remove()
    assert outcome.item_reasons == ["skipped", "completed"] and outcome.steps == 3 + NEW
    assert [OURS in names for names in checks] == [False, False] + [True] * (1 + NEW)


def test_a_timeout_arms_the_criterion_shortly_before_it_expires(text_model, tokenizer, checks):
    ids = tokenizer(["Hello world"], return_tensors="pt")
    original = text_model.transformer.h[1].mlp
    slow_down(text_model, "transformer.h.1.mlp", SlowLayer(seconds=0.25))  # each forward takes 0.25 s
    try:
        outcome = stopcock.run(
            text_model, **ids, max_new_tokens=NEW, do_sample=False, stop=stopcock.timeout(1.0)
        )
    finally:
        text_model.transformer.h[1].mlp = original
    assert (outcome.stopped, outcome.reason) == (True, "timeout") and outcome.steps < NEW
    # the first check is at 0.25 s, long before the criterion is armed (ARM_AHEAD before 1 s); the last has it
    assert OURS not in checks[0] and OURS in checks[-1] and len(checks) == outcome.steps


def test_what_must_see_every_token_keeps_the_criterion_in_the_loop(text_model, tokenizer, checks):
    ids = tokenizer(["Hello world"], return_tensors="pt")
    for stop in (stopcock.max_steps(100), stopcock.stop_strings(["zzz"]), stopcock.when(lambda state: False)):
        checks.clear()
        stopcock.run(text_model, **ids, max_new_tokens=3, do_sample=False, stop=stop, tokenizer=tokenizer)
        assert [OURS in names for names in checks] == [True] * 3, stop
    checks.clear()
    beams = stopcock.StopSignal()
    stopcock.run(text_model, **ids, max_new_tokens=3, num_beams=2, do_sample=False, stop=beams)
    assert checks and all(OURS in names for names in checks)  # beam search: not the loop that may wait


# -- abort mode: armed when a stop becomes possible, then within one module call -------------------------
def test_abort_mode_installs_nothing_until_the_stop_then_aborts_inside_the_block(text_model, tokenizer):
    ids = tokenizer(["Hello world"], return_tensors="pt")
    expected = text_model.generate(**ids, max_new_tokens=NEW, do_sample=False)
    block = text_model.transformer.h[0]
    signal, hooked_at_forward = stopcock.StopSignal(), []  # (modules with pre-hooks, global hooks)
    calls = {"attn": 0, "mlp": 0}

    def after_attention(module, args, output):
        calls["attn"] += 1
        if calls["attn"] == 4:  # inside the forward of the 4th token, between attention and MLP
            signal.stop("inside")

    handles = [
        text_model.register_forward_pre_hook(
            lambda m, a: hooked_at_forward.append((len(hooked(text_model)), global_hooks()))
        ),
        block.attn.register_forward_hook(after_attention),
        block.mlp.register_forward_hook(lambda m, a, o: calls.__setitem__("mlp", calls["mlp"] + 1)),
    ]
    try:
        outcome = stopcock.run(
            text_model, **ids, max_new_tokens=NEW, do_sample=False, stop=signal, mode="abort"
        )
    finally:
        for h in handles:
            h.remove()
    assert hooked_at_forward == [(1, 0)] * 4  # only the test's own hook, in every forward before the stop
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.mode) == (True, "inside", 3, "abort")
    assert calls == {"attn": 4, "mlp": 3}  # aborted at the next module call, inside the block
    assert torch.equal(outcome.output, expected[:, : ids["input_ids"].shape[1] + 3])
    assert hooked(text_model) == [] and global_hooks() == 0
    again = stopcock.run(text_model, **ids, max_new_tokens=NEW, do_sample=False, mode="abort")
    assert torch.equal(again.output, expected)  # the next run is bit-identical


def test_a_diffusers_abort_lands_at_the_next_module_and_the_next_run_is_identical(count_forwards):
    pipe = tiny.stable_diffusion_pipeline()

    def kwargs():
        return {"prompt": "a cat", "num_inference_steps": 4, "generator": torch.Generator().manual_seed(0),
                "output_type": "np"}

    reference = pipe(**kwargs()).images
    resnet = pipe.unet.mid_block.resnets[0]
    signal, seen = stopcock.StopSignal(), []
    calls = count_forwards(resnet.norm1, resnet.conv1, resnet.norm2)
    handle = resnet.conv1.register_forward_hook(lambda m, a, o: len(seen) == 2 and signal.stop("inside"))
    try:
        outcome = stopcock.run(pipe, **kwargs(), stop=signal, mode="abort", on_step=seen.append)
    finally:
        handle.remove()
    assert (outcome.reason, outcome.steps, outcome.output) == ("inside", 2, None)
    assert (calls[resnet.norm1], calls[resnet.conv1], calls[resnet.norm2]) == (3, 3, 2)
    assert all(not hooked(m) for m in pipe.components.values() if isinstance(m, nn.Module))
    assert global_hooks() == 0
    assert (pipe(**kwargs()).images == reference).all()


@pytest.mark.parametrize("entered", [True, False], ids=["entered", "not entered"])
def test_a_users_signal_arms_the_checks_whether_or_not_the_control_was_entered(entered):
    """Entered, the control forwards the user's stop to its token, which arms; not entered, the
    user's signal arms directly."""
    signal = stopcock.StopSignal()
    control = RunControl(signal, mode="abort")
    if entered:
        control.__enter__()
    with control.intercept():
        assert global_hooks() == 0
        signal.stop("now")
        assert global_hooks() == 1
    assert global_hooks() == 0
    control.close()


def test_a_timeout_arms_abort_mode_shortly_before_it_expires(text_model, tokenizer):
    ids = tokenizer(["Hello world"], return_tensors="pt")
    slow = SlowLayer(hold_at=0)  # the prefill never ends by itself: only the timeout ends it
    original = text_model.transformer.h[1].mlp
    slow_down(text_model, "transformer.h.1.mlp", slow)
    seen_at_start: list[int] = []
    handle = text_model.register_forward_pre_hook(
        lambda m, a: seen_at_start.append((len(hooked(text_model)), global_hooks()))
    )
    try:
        outcome = stopcock.run(
            text_model, **ids, max_new_tokens=NEW, stop=stopcock.timeout(0.2), mode="abort"
        )
    finally:
        handle.remove()
        text_model.transformer.h[1].mlp = original
    assert seen_at_start == [(1, 0)]  # nothing of stopcock's when the forward began
    assert (outcome.stopped, outcome.reason, outcome.steps, outcome.mode) == (True, "timeout", 0, "abort")
    assert torch.equal(outcome.output, ids["input_ids"]) and hooked(text_model) == [] and global_hooks() == 0


class Always(Condition):
    """A condition of the user's own: it may fire at any moment, so abort mode arms at once."""

    reason = "mine"

    def __init__(self) -> None:
        self.fire = False

    def check(self, state):
        return self.reason if self.fire else None


def fired_at_third_forward(text_model, tokenizer, mine, stop):
    """An abort-mode run in which ``mine`` fires from the third forward of the model on; the run's
    Outcome, and the global hooks installed at the start of each forward."""
    ids = tokenizer(["Hello world"], return_tensors="pt")
    counts: list[int] = []

    def count(module, args):
        counts.append(global_hooks())
        mine.fire = len(counts) == 3

    handle = text_model.register_forward_pre_hook(count)
    try:
        outcome = stopcock.run(
            text_model, **ids, max_new_tokens=NEW, do_sample=False, stop=stop, mode="abort"
        )
    finally:
        handle.remove()
    return outcome, counts


def test_a_condition_of_your_own_is_armed_from_the_start(text_model, tokenizer):
    mine = Always()
    outcome, counts = fired_at_third_forward(text_model, tokenizer, mine, mine)
    assert counts[0] == 1  # armed before the first forward
    assert (outcome.reason, outcome.steps, outcome.mode) == ("mine", 2, "abort")


class AtBoundaries(Always):
    """A condition of the user's own that says it never fires inside a forward."""

    fires_in_forward = False

    def check(self, state):
        return None if state.block else super().check(state)


def test_a_condition_that_never_fires_in_a_forward_arms_abort_mode_only_once_stopped(text_model, tokenizer):
    mine = AtBoundaries()
    outcome, counts = fired_at_third_forward(text_model, tokenizer, mine, [mine, stopcock.PauseSignal()])
    assert counts == [0, 0, 0]  # never armed: it fires at the boundary after the third forward
    assert (outcome.reason, outcome.steps, outcome.mode) == ("mine", 3, "abort")
    assert global_hooks() == 0


def test_a_pipelines_generate_settings_follow_its_generation_config(text_model_dir, tokenizer):
    """What a run reads of a text pipeline's generate settings (its total, how rows end) follows its
    generation config and the call's arguments: a change of either is seen at the next run."""
    from transformers import AutoModelForCausalLM, pipeline

    model = AutoModelForCausalLM.from_pretrained(text_model_dir).eval()
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    stop = stopcock.max_steps(2)
    default = stopcock.run(pipe, "Hello", stop=stop, do_sample=False)  # the pipeline's max_new_tokens
    again = stopcock.run(pipe, "Hello", stop=stop, do_sample=False)
    model.generation_config.max_new_tokens = 5
    from_config = stopcock.run(pipe, "Hello", stop=stop, do_sample=False)
    from_call = stopcock.run(pipe, "Hello", stop=stop, do_sample=False, max_new_tokens=7)
    model.generation_config.max_new_tokens = None
    back = stopcock.run(pipe, "Hello", stop=stop, do_sample=False)
    totals = [o.total_steps for o in (default, again, from_config, from_call, back)]
    assert totals == [256, 256, 5, 7, 256]
    ids = tokenizer("Hello", return_tensors="pt").input_ids
    before = stopcock.run(pipe, "Hello", do_sample=False, max_new_tokens=3)
    first = model.generate(ids, do_sample=False, max_new_tokens=1)[0, -1].item()
    model.generation_config.eos_token_id = first  # the first token generated now ends the row
    after = stopcock.run(pipe, "Hello", do_sample=False, max_new_tokens=3)
    assert (before.row_reasons, after.row_reasons, after.steps) == (["length"], ["eos"], 1)


@pytest.mark.parametrize(
    "build", [tiny.stable_diffusion_pipeline, tiny.sdxl_pipeline, tiny.ddpm_pipeline, tiny.flux_pipeline,
              tiny.semantic_pipeline, tiny.modular_sdxl_pipeline],
)
def test_a_run_reads_the_components_diffusers_reports(build):
    """The components a run binds, read without diffusers' per-call signature walk, are diffusers' own."""
    from stopcock.adapters.diffusers_parts import components

    pipe = build()
    theirs = {name: c for name, c in dict(pipe.components).items() if c is not None}
    ours = components(pipe)
    assert list(ours) == list(theirs) and all(ours[name] is theirs[name] for name in theirs)
