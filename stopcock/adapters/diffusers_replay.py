"""Checkpoint and resume diffusers pipelines by replay: bit-identical, for every pipeline kind.

Recording: the loop models (the denoisers, and ControlNets: the models a loop calls at every step)
show each output to a :class:`_Replay` source (:func:`stopcock.intercept.answering`), which keeps
a copy, grouped by step, with the shapes of the call's tensors. At each step boundary it also
keeps the latents and the state of the loop models' stateful cache hooks (FirstBlockCache,
TaylorSeer). The checkpoint holds the calls of the steps done, the latents and hook state of the
last one, the call's arguments as they were when it started (generators at their starting state;
the global RNG state as well when no generator is given) and the pipeline's fingerprint.

Resuming makes the same call again with the loop models answering their first calls from the
checkpoint without computing (no forward, no hook of any kind, no offload transfer), so the
scheduler rebuilds all its own state (multistep history, ancestral noise drawn from the generator)
by itself; the cache hooks get their state back just before the first call that computes. At the
checkpoint's step the latents must equal the saved ones exactly (else :class:`CheckpointMismatch`);
from there the run is the one never stopped. The cost of recording is one copy of each loop model
output per step (about one latent); the callbacks of the pipeline run again for replayed steps
(the loop itself runs), but ``on_step`` is not called again for them.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

import torch
from diffusers.hooks.hooks import StateManager
from diffusers.utils import BaseOutput

from ..checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointMismatch,
    ObjectState,
    config_data,
    digest,
    freeze_call,
    model_fingerprint,
    restore_rng,
    rng_state,
    versions,
    vocab_digest,
)
from ..control import RunControl
from ..intercept import COMPUTE, answering
from ..outcome import Outcome
from ..state import StepState
from .diffusers import DiffusersAdapter
from .resumable import ResumeScaffold

__all__ = ["ADAPTER", "ResumableDiffusersAdapter", "fingerprint", "loop_models"]

#: Words in the component names of the denoising models (unet, transformer, transformer_2, prior,
#: decoder, ...).
DENOISER_WORDS = frozenset({"unet", "transformer", "prior", "decoder", "denoiser"})


def loop_models(pipe: Any) -> dict[str, torch.nn.Module]:
    """The models the denoising loop calls at every step, by component name: the denoisers (not an
    encoder named after its stage, such as ``prior_image_encoder``) and ControlNets."""
    controlnets = {
        name: m
        for name, m in dict(pipe.components).items()
        if isinstance(m, torch.nn.Module) and "controlnet" in name
    }
    found = {
        name: m
        for name, m in dict(pipe.components).items()
        if isinstance(m, torch.nn.Module)
        and DENOISER_WORDS & set(words := name.split("_"))
        and not {"text", "vae", "encoder"} & set(words)
    }
    return {**found, **controlnets}


# -- calls and outputs as data --------------------------------------------------------------------
def _shape(value: Any) -> str:
    """A call's inputs, cheaply (no device sync): tensors by dtype and shape, plain values as they are."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(_shape, value)) + "]"
    if isinstance(value, dict):
        return (
            "{"
            + ",".join(f"{k}={_shape(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0])))
            + "}"
        )
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def _inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return _shape(list(args)) + _shape(kwargs)


def _output_data(output: Any) -> Any:
    """A loop model's output as data, its tensors copied (the loop may change them in place)."""
    if isinstance(output, torch.Tensor):
        return output.detach().clone()
    if isinstance(output, BaseOutput):
        return ObjectState(type(output).__name__, {k: _output_data(v) for k, v in output.items()})
    if isinstance(output, (list, tuple)):
        return type(output)(_output_data(v) for v in output)
    if type(output) is dict:
        return {k: _output_data(v) for k, v in output.items()}
    if output is None or isinstance(output, (bool, int, float, str)):
        return output
    raise CheckpointError(f"a loop model returned a {type(output).__name__}, which stopcock cannot record")


def _output_class(module: torch.nn.Module, name: str) -> type:
    """The output class ``name`` of ``module``, looked up where its classes are defined (never imported)."""
    for cls in type(module).__mro__:
        found = vars(sys.modules.get(cls.__module__, object)).get(name)
        if isinstance(found, type) and issubclass(found, BaseOutput):
            return found
    raise CheckpointError(
        f"the checkpoint names an output class {name!r} that {type(module).__name__} does not have"
    )


def _output(data: Any, module: torch.nn.Module, device: torch.device) -> Any:
    """The output :func:`_output_data` kept, rebuilt on ``device`` (tensors copied)."""
    if isinstance(data, torch.Tensor):
        return data.to(device=device, copy=True)
    if isinstance(data, ObjectState):
        fields = {k: _output(v, module, device) for k, v in data.attributes.items()}
        return _output_class(module, data.cls)(**fields)
    if isinstance(data, (list, tuple)):
        return type(data)(_output(v, module, device) for v in data)
    if type(data) is dict:
        return {k: _output(v, module, device) for k, v in data.items()}
    return data


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """Where a call's output goes: the device of its first tensor argument."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")


# -- cache hook state --------------------------------------------------------------------------------
def _managers(model: torch.nn.Module) -> list[StateManager]:
    """The state managers of ``model``'s stateful diffusers hooks, each once, in a fixed order."""
    found: dict[int, StateManager] = {}
    for _, sub in model.named_modules():
        registry = vars(sub).get("_diffusers_hook")
        for name in getattr(registry, "_hook_order", ()):
            hook = registry.hooks[name]
            if not hook._is_stateful:
                continue
            managers = [v for v in vars(hook).values() if isinstance(v, StateManager)]
            if not managers:
                raise CheckpointError(
                    f"{type(model).__name__} has a stateful hook ({type(hook).__name__}) whose state stopcock"
                    " cannot see: disable it to checkpoint this pipeline"
                )
            found.update({id(m): m for m in managers})
    return list(found.values())


def _copied(value: Any) -> Any:
    """Containers copied, tensors and the rest shared: hooks replace their state, never change it in place."""
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def _on(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_on(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _on(v, device) for k, v in value.items()}
    return value


def _snapshot(managers: list[StateManager]) -> list[dict[str, ObjectState]]:
    return [
        {
            ctx: ObjectState(type(state).__name__, _copied(vars(state)))
            for ctx, state in m._state_cache.items()
        }
        for m in managers
    ]


def _restore(
    managers: list[StateManager], snapshot: list[dict[str, ObjectState]], device: torch.device
) -> None:
    if len(snapshot) != len(managers):
        raise CheckpointMismatch(
            f"the checkpoint holds the state of {len(snapshot)} cache hooks, this model has {len(managers)}:"
            " enable the same cache as when it was made"
        )
    for manager, states in zip(managers, snapshot, strict=True):
        make: Any = manager._state_cls
        cache = {}
        for ctx, saved in states.items():
            if saved.cls != make.__name__:
                raise CheckpointMismatch(
                    f"a cache hook's state is a {saved.cls} in the checkpoint, a"
                    f" {make.__name__} here: enable the same cache"
                )
            state = make(*manager._init_args, **manager._init_kwargs)
            vars(state).update(_on(_copied(saved.attributes), device))
            cache[ctx] = state
        manager._state_cache = cache


# -- the source ------------------------------------------------------------------------------------------
class _Replay:
    """The loop models' source for one run: answers the calls recorded in ``saved`` (a checkpoint's
    state; none when the run starts from scratch), lets the rest compute, and records every call by step
    until ``control`` (the run's) has seen the stop: what runs after it (a fast-forwarded tail, a combined
    pipeline's next stage) is the finish of a stopped run, not work a resume can skip."""

    def __init__(
        self,
        models: dict[str, torch.nn.Module],
        saved: dict[str, Any] | None = None,
        control: RunControl | None = None,
    ) -> None:
        self.models = models
        self.control = control
        self.names = {id(m): name for name, m in models.items()}
        self.managers = {name: _managers(m) for name, m in models.items()}
        self.saved = saved
        self.queue: deque[dict[str, Any]] = deque(c for step in (saved or {}).get("calls", ()) for c in step)
        self.replayed = len((saved or {}).get("calls", ()))  # the steps a resume answers
        self.steps: list[list[dict[str, Any]]] = []  # the calls of each step done
        self.current: list[dict[str, Any]] = []
        self.latents: Any = None
        self.hooks: dict[str, Any] = {}

    def _after_stop(self) -> bool:
        return self.control is not None and self.control.seen

    def answer(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.queue:
            if self.saved is not None and self.saved.get("hooks"):
                device = _device_of(args, kwargs)
                for name, snapshot in self.saved["hooks"].items():
                    _restore(self.managers[name], snapshot, device)
                self.saved = {**self.saved, "hooks": None}  # once, before the first call that computes
            return COMPUTE
        call = self.queue.popleft()
        name, inputs = self.names[id(module)], _inputs(args, kwargs)
        if (call["model"], call["inputs"]) != (name, inputs):
            number = sum(map(len, self.steps)) + len(self.current) + 1
            raise CheckpointMismatch(
                f"the resumed run's loop model call {number} is {name}({inputs}), the checkpoint's is"
                f" {call['model']}({call['inputs']}): resume with the same pipeline and arguments"
            )
        self.current.append(call)
        return _output(call["output"], module, _device_of(args, kwargs))

    def observe(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._after_stop():
            return
        self.current.append(
            {"model": self.names[id(module)], "inputs": _inputs(args, kwargs), "output": _output_data(output)}
        )

    def boundary(self, state: StepState) -> None:
        """A step is done: close its calls, keep its latents and the cache hooks' state."""
        if self._after_stop():
            return
        self.steps.append(self.current)
        self.current = []
        self.latents = state.latents.clone() if isinstance(state.latents, torch.Tensor) else state.latents
        self.hooks = {name: _snapshot(ms) for name, ms in self.managers.items() if ms}
        saved = self.saved
        if saved is not None and state.step == self.replayed and isinstance(state.latents, torch.Tensor):
            if not torch.equal(state.latents, saved["latents"].to(state.latents.device)):
                raise CheckpointMismatch(
                    f"replaying {self.replayed} steps did not give the checkpoint's latents: the pipeline"
                    " (scheduler, weights, cache) is not the one the checkpoint was made with"
                )

    def state(self, call: dict[str, Any], rng: Any, steps: int) -> dict[str, Any]:
        return {
            "call": call,
            "rng": rng,
            "calls": self.steps[:steps],
            "latents": self.latents,
            "hooks": self.hooks,
        }


def fingerprint(pipe: Any) -> dict[str, Any]:
    """What a resume must match: classes, configs, weights, tokenizers, cache hooks, dtype, device and
    the versions of the libraries its classes come from."""
    device = getattr(pipe, "_execution_device", None)
    components: dict[str, Any] = {}
    for name, c in dict(pipe.components).items():
        if c is None:
            continue
        if isinstance(c, torch.nn.Module):
            components[name] = model_fingerprint(c, device)
            hooks = sorted(
                type(h).__name__
                for _, sub in c.named_modules()
                for h in getattr(vars(sub).get("_diffusers_hook"), "hooks", {}).values()
            )
            if hooks:
                components[name]["hooks"] = digest(hooks)
        elif hasattr(c, "get_vocab"):
            components[name] = {"class": type(c).__name__, "vocab": vocab_digest(c)}
        elif getattr(c, "config", None) is not None:
            components[name] = {"class": type(c).__name__, "config": config_data(c.config)}
        elif hasattr(c, "to_dict"):
            components[name] = {"class": type(c).__name__, "config": digest(c.to_dict())}
        else:
            components[name] = {"class": type(c).__name__}
    return {
        "kind": "diffusers",
        "target": type(pipe).__name__,
        "versions": versions(pipe, *dict(pipe.components).values()),
        "components": components,
    }


def _steps_hook(control: RunControl, source: _Replay, skip_until: int) -> None:
    """Route each step boundary to ``source``, then to the user's ``on_step`` (not for replayed steps)."""
    user = control.on_step

    def on_step(state: StepState) -> object:
        source.boundary(state)
        return None if user is None or state.step <= skip_until else user(state)

    control.on_step = on_step


def _made(pipe: Any, source: _Replay, call: dict[str, Any], rng: Any, outcome: Outcome) -> Checkpoint:
    return Checkpoint(
        kind="diffusers",
        steps=len(source.steps),
        total=outcome.total_steps,
        fingerprint=fingerprint(pipe),
        state=source.state(call, rng, len(source.steps)),
    )


class ResumableDiffusersAdapter(ResumeScaffold, DiffusersAdapter):
    """The diffusers adapter with the :class:`~stopcock.adapters.base.Resumable` capability: replay."""

    def record(
        self, target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], control: RunControl, **options: Any
    ) -> Outcome:
        """``run(...)`` with ``checkpoint=True``: the Outcome carries a :class:`Checkpoint`."""
        call = freeze_call(args, kwargs)
        rng = None if kwargs.get("generator") is not None else rng_state()  # else the global RNG draws
        source = _Replay(loop_models(target), control=control)
        _steps_hook(control, source, 0)
        with answering(source.models.values(), source):
            outcome = self.run(target, args, kwargs, control, **options)
        outcome.checkpoint = _made(target, source, call, rng, outcome)
        return outcome

    def fingerprint(self, target: Any) -> dict[str, Any]:
        return fingerprint(target)

    def continued(
        self,
        target: Any,
        checkpoint: Checkpoint,
        control: RunControl,
        call: dict[str, Any],
        *,
        record: bool,
        **options: Any,
    ) -> tuple[Outcome, dict[str, Any]]:
        """Continue ``checkpoint`` on ``target`` by replay (see the module docstring)."""
        state = checkpoint.state
        if state["rng"] is not None:
            restore_rng(state["rng"])
        source = _Replay(loop_models(target), state, control)
        _steps_hook(control, source, checkpoint.steps)
        with answering(source.models.values(), source):
            outcome = self.run(target, tuple(call["args"]), call["kwargs"], control, **options)
        done = len(source.steps)  # the steps before the stop (replayed ones included)
        if record:  # a resume stopped before the checkpoint's step keeps the checkpoint: it is further on
            further = done < checkpoint.steps
            outcome.checkpoint = (
                checkpoint if further else _made(target, source, state["call"], state["rng"], outcome)
            )
        return outcome, {"saved_steps": min(checkpoint.steps, done), "exact": True, "how": "replay"}


ADAPTER = ResumableDiffusersAdapter()
