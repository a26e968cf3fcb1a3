"""Models compiled with ``torch.compile`` run under stopcock as they run without it (tiny real pipelines).

torch runs a module's hooks inside the compiled call when the module is compiled in place
(``module.compile()``), and a hook's thread check cannot be traced into a graph: stopcock's hooks are
wrappers of a module's call, around the compiled call of such a model (its graph is not touched, so
nothing recompiles), and the abort check is a no-op inside a graph (the next check outside one lands
the abort). The
tests compile with ``fullgraph=True``, where anything torch could not trace would raise, and the
"eager" backend (dynamo's tracing and guards, no code generation).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import stopcock
from stopcock.hooks import input_hooks, output_hooks
from tiny import image as tiny

STEPS = 4
CALL = {"num_inference_steps": STEPS, "output_type": "np"}


def seeded() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_a_run_neither_fails_nor_recompiles_a_unet_compiled_in_place(mode):
    pipe = tiny.stable_diffusion_pipeline()
    pipe.unet.compile(backend="eager", fullgraph=True)
    compiled = vars(pipe.unet)["_compiled_call_impl"]
    expected = pipe("a cat", **CALL, generator=seeded()).images
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1  # the plain call compiled the UNet
    outcome = stopcock.run(pipe, "a cat", **CALL, generator=seeded(), stop=stopcock.StopSignal(), mode=mode)
    assert outcome.reason == "completed" and counters["stats"]["unique_graphs"] == graphs
    np.testing.assert_array_equal(outcome.output.images, expected)
    assert vars(pipe.unet)["_compiled_call_impl"] is compiled


def test_a_finish_stop_fast_forwards_a_unet_compiled_in_place():
    """LCM's loop ignores the interrupt flag: the UNet's recorded output of the stop step answers the
    remaining iterations, recorded around the compiled call."""
    stop = stopcock.max_steps(2)
    expected = stopcock.run(tiny.lcm_pipeline(), "a cat", **CALL, generator=seeded(), stop=stop)
    pipe = tiny.lcm_pipeline()
    pipe.unet.compile(backend="eager", fullgraph=True)
    full = pipe("a cat", **CALL, generator=seeded()).images
    outcome = stopcock.run(pipe, "a cat", **CALL, generator=seeded(), stop=stop)
    assert outcome.extra["path"] == "fast-forward" and outcome.extra["answered"] == STEPS - 2
    np.testing.assert_array_equal(outcome.output.images, expected.output.images)
    np.testing.assert_array_equal(pipe("a cat", **CALL, generator=seeded()).images, full)


@pytest.mark.parametrize(("compiled", "steps"), [
    ("not", 2),  # the abort lands inside the next step's UNet call
    ("blocks", 2),  # diffusers' regional compile: checked between the compiled blocks
    ("in place", 3),  # one graph for the whole UNet call: it ends, the step boundary aborts
])
def test_an_abort_lands_at_the_first_check_outside_a_compiled_graph(compiled, steps):
    pipe = tiny.stable_diffusion_pipeline()
    if compiled == "blocks":
        pipe.unet.compile_repeated_blocks(backend="eager", fullgraph=True)
    elif compiled == "in place":
        pipe.unet.compile(backend="eager", fullgraph=True)
    expected = pipe("a cat", **CALL, generator=seeded()).images
    signal = stopcock.StopSignal()

    def stop_after_two_steps(pipe, i, t, kwargs):
        if i == 1:
            signal.stop("user")
        return kwargs

    outcome = stopcock.run(pipe, "a cat", **CALL, generator=seeded(), stop=signal, mode="abort",
                           callback_on_step_end=stop_after_two_steps)
    assert outcome.stopped and outcome.reason == "user" and outcome.mode == "abort"
    assert outcome.steps == steps
    np.testing.assert_array_equal(pipe("a cat", **CALL, generator=seeded()).images, expected)


class Layer(torch.nn.Module):  # a module of its own: torch's built-in ones are not compiled alone
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


@pytest.mark.parametrize("in_place", [False, True])
def test_hooks_wrap_a_modules_call_on_this_thread_only_and_add_no_torch_hook(in_place):
    """Not compiled: the module keeps torch's fast path (no hook of ours); compiled in place: the
    wrapper goes around its compiled call, which stays the same object."""
    layer = Layer()
    layer.register_forward_hook(lambda module, args, output: output + 1)  # the user's own hook
    if in_place:
        layer.compile(backend="eager", fullgraph=True)
    compiled = vars(layer).get("_compiled_call_impl")
    x = torch.ones(1, 4)
    with torch.no_grad():
        expected = layer(x)
        inputs, elsewhere, torch_hooks = [], [], []
        with input_hooks([layer], lambda module, args, kwargs: inputs.append((module, args))), \
                output_hooks([layer], lambda module, output: output * 2):  # a replacement output
            torch_hooks.append((len(layer._forward_pre_hooks), len(layer._forward_hooks)))
            doubled = layer(x)
            other = threading.Thread(target=lambda: elsewhere.append(layer(x)))
            other.start()
            other.join()
        after = layer(x)
    assert torch_hooks == [(0, 1)]  # only the user's: no hook of ours sends the call down torch's slow path
    torch.testing.assert_close(doubled, expected * 2)  # the wrapper sees the output after the user's hook
    assert len(inputs) == 1 and inputs[0][0] is layer and inputs[0][1][0] is x
    torch.testing.assert_close(elsewhere[0], expected)  # another thread's call: not wrapped
    assert vars(layer).get("_compiled_call_impl") is compiled and "_call_impl" not in vars(layer)
    torch.testing.assert_close(after, expected)
