"""Checkpoints: what a stopped run needs to resume exactly, in a file that loading cannot run code from.

``run(..., checkpoint=True)`` puts a :class:`Checkpoint` on the Outcome; ``stopcock.resume(target,
checkpoint)`` continues it. In memory a checkpoint holds Python values: the adapter's state of the
run, the call's arguments as they were when it started (tensors copied, generators as their
starting state, arguments that are not data, such as callbacks, kept as they are), the
fingerprint of the target it ran on, and ``notes`` for the caller's own data.

``save(path)`` writes one safetensors file: the tensors, and everything else as JSON in the file's
metadata, with a SHA-256 digest over both. ``Checkpoint.load(path)`` checks the digest and decodes
data only: JSON values and a closed list of typed values (tensors, dtypes, devices, generator
states, images, arrays, and :class:`ObjectState`, the attributes of an object that its adapter
rebuilds from classes it names itself). Nothing is unpickled. An argument that is not data is saved
as its name (:class:`Live`), and ``resume`` asks for it again.

A fingerprint says what a resume must match (classes, configs, a sample of the weights, dtype,
device, the versions of the libraries the target depends on); :func:`check_fingerprint` refuses a
mismatch, naming each difference.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .versions import versions

__all__ = [
    "FORMAT",
    "Checkpoint",
    "CheckpointError",
    "CheckpointMismatch",
    "GeneratorState",
    "Live",
    "ObjectState",
    "check_fingerprint",
    "config_data",
    "digest",
    "freeze",
    "freeze_call",
    "lives",
    "model_fingerprint",
    "remembered",
    "restore_rng",
    "rng_state",
    "thaw",
    "versions",
    "vocab_digest",
]

FORMAT = "stopcock-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: not one, damaged or modified, or not resumable as asked."""


class CheckpointMismatch(CheckpointError):
    """The target given to ``resume`` is not the one the checkpoint was made with."""


# -- typed values -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GeneratorState:
    """A ``torch.Generator`` as data: its device and its state (made into a generator by :func:`thaw`)."""

    device: str
    state: torch.Tensor

    @classmethod
    def of(cls, generator: torch.Generator) -> GeneratorState:
        return cls(str(generator.device), generator.get_state())

    def generator(self) -> torch.Generator:
        return torch.Generator(self.device).set_state(self.state)


@dataclass(frozen=True)
class ObjectState:
    """An object as data: its class name and attributes. The adapter that made it rebuilds it, from
    the classes it allows (a checkpoint file never names a class that gets imported or called)."""

    cls: str
    attributes: dict[str, Any]


@dataclass(frozen=True)
class Live:
    """A call argument that is not data (a callback, a streamer): saved as its name only."""

    name: str
    type: str


class _NotData(TypeError):
    pass


def freeze(value: Any) -> Any:
    """A call argument as a resume needs it: tensors copied, generators as their state now; lists,
    tuples and dicts frozen item by item; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, torch.Generator):
        return GeneratorState.of(value)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(freeze(v) for v in value)
    if type(value) is dict:
        return {k: freeze(v) for k, v in value.items()}
    return value


def freeze_call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A call's arguments, frozen (:func:`freeze`): the ``call`` entry of a checkpoint's state."""
    return {"args": [freeze(a) for a in args], "kwargs": {k: freeze(v) for k, v in kwargs.items()}}


def thaw(value: Any, given: Mapping[str, Any]) -> Any:
    """The inverse of :func:`freeze`: fresh generators at their saved state, fresh copies of tensors
    (a run may change its inputs in place), and each :class:`Live` replaced by ``given[its name]``."""
    if isinstance(value, Live):
        if value.name not in given:
            raise CheckpointError(
                f"the checkpointed call had {value.name}= (a {value.type}), which a file cannot hold:"
                f" pass it again, e.g. stopcock.resume(target, checkpoint, {value.name}=...)"
            )
        return given[value.name]
    if isinstance(value, GeneratorState):
        return value.generator()
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(thaw(v, given) for v in value)
    if type(value) is dict:
        return {k: thaw(v, given) for k, v in value.items()}
    return value


def lives(value: Any) -> Iterator[Live]:
    """The :class:`Live` arguments inside ``value``."""
    if isinstance(value, Live):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from lives(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from lives(v)


# -- the file format --------------------------------------------------------------------------------
class _Encoder:
    """Typed values to JSON, with the tensors collected apart (one safetensors entry each)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def _tensor(self, t: torch.Tensor) -> str:
        name = f"t{len(self.tensors)}"
        self.tensors[name] = t.detach().to("cpu").clone().contiguous()  # a copy: no shared storage
        return name

    def encode(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.Tensor):
            return {"t": "tensor", "k": self._tensor(v)}
        if isinstance(v, torch.dtype):
            return {"t": "dtype", "v": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"t": "device", "v": str(v)}
        if isinstance(v, GeneratorState):
            return {"t": "generator", "device": v.device, "k": self._tensor(v.state)}
        if isinstance(v, ObjectState):
            return {"t": "object", "class": v.cls, "v": {k: self.encode(a) for k, a in v.attributes.items()}}
        if isinstance(v, Live):
            return {"t": "live", "name": v.name, "type": v.type}
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return {"t": "tuple", "v": [self.encode(x) for x in v]}
        if isinstance(v, list):
            return {"t": "list", "v": [self.encode(x) for x in v]}
        if type(v) is dict:
            return {"t": "dict", "v": [[self.encode(k), self.encode(x)] for k, x in v.items()]}
        module = type(v).__module__.split(".")[0]
        if module == "PIL" and hasattr(v, "mode"):
            import numpy as np

            return {"t": "image", "mode": v.mode, "k": self._tensor(torch.from_numpy(np.array(v)))}
        if module == "numpy" and hasattr(v, "dtype") and v.dtype != object:
            import numpy as np

            return {"t": "ndarray", "k": self._tensor(torch.from_numpy(np.array(v)))}
        raise _NotData(type(v).__name__)

    def encode_call(self, call: Mapping[str, Any]) -> Any:
        """A call's arguments ``{"args": [...], "kwargs": {...}}``: one that is not data becomes a
        :class:`Live` of its name (a positional one cannot be given again by name: an error)."""
        args = []
        for i, value in enumerate(call["args"]):
            try:
                args.append(self.encode(value))
            except _NotData:
                raise CheckpointError(
                    f"positional argument {i} of the checkpointed call (a {type(value).__name__}) is not"
                    " data and cannot be saved: pass it by name, so that resume can be given it again"
                ) from None
        kwargs = {}
        for name, value in call["kwargs"].items():
            try:
                kwargs[name] = self.encode(value)
            except _NotData:
                kwargs[name] = self.encode(Live(name, type(value).__name__))
        return {"t": "call", "args": args, "kwargs": kwargs}


class _Decoder:
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def _tensor(self, name: Any) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"the checkpoint refers to a tensor {name!r} it does not hold")
        return self.tensors[name]

    def decode(self, v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if not isinstance(v, dict) or "t" not in v:
            raise CheckpointError(f"the checkpoint holds a value stopcock does not write: {str(v)[:80]}")
        tag = v["t"]
        if tag == "tensor":
            return self._tensor(v["k"])
        if tag == "dtype":
            dtype = getattr(torch, str(v["v"]), None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown dtype {v['v']!r} in the checkpoint")
            return dtype
        if tag == "device":
            return torch.device(str(v["v"]))
        if tag == "generator":
            return GeneratorState(str(v["device"]), self._tensor(v["k"]))
        if tag == "object":
            return ObjectState(str(v["class"]), {str(k): self.decode(a) for k, a in v["v"].items()})
        if tag == "live":
            return Live(str(v["name"]), str(v["type"]))
        if tag in ("tuple", "list"):
            items = [self.decode(x) for x in v["v"]]
            return tuple(items) if tag == "tuple" else items
        if tag == "dict":
            return {self.decode(k): self.decode(x) for k, x in v["v"]}
        if tag == "call":
            return {
                "args": [self.decode(x) for x in v["args"]],
                "kwargs": {str(k): self.decode(x) for k, x in v["kwargs"].items()},
            }
        if tag == "image":
            from PIL import Image

            return Image.fromarray(self._tensor(v["k"]).numpy(), mode=str(v["mode"]))
        if tag == "ndarray":
            return self._tensor(v["k"]).numpy()
        raise CheckpointError(f"the checkpoint holds a value of a kind stopcock does not write: {tag!r}")


def _content_digest(text: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the JSON and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(text.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@dataclass
class Checkpoint:
    """What ``resume`` needs to continue a run exactly. ``steps`` were done when it was taken.

    ``kind`` names the adapter that made it and resumes it; ``state`` is that adapter's (including
    the call's frozen arguments); ``fingerprint`` what the target must match; ``notes`` the caller's
    own data, saved with it (data only: JSON values, tensors, the typed values above).
    """

    kind: str
    steps: int
    total: int | None
    fingerprint: dict[str, Any]
    state: dict[str, Any]
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def live(self) -> list[str]:
        """The names of the call's arguments that are not data: ``resume`` needs them again once the
        checkpoint has been through a file (in memory it still holds them)."""
        return [live.name for live in lives(self.state)]

    def describe(self) -> str:
        total = f" of {self.total}" if self.total is not None else ""
        return (
            f"{self.kind} checkpoint of a {self.fingerprint.get('target', '?')} at step {self.steps}{total}"
        )

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the checkpoint to ``path`` (one safetensors file; replaced atomically). Returns the path."""
        from safetensors.torch import save_file

        path = Path(path)
        encoder = _Encoder()
        try:
            state = {
                k: encoder.encode_call(v) if k == "call" else encoder.encode(v) for k, v in self.state.items()
            }
            notes = encoder.encode(self.notes)
        except _NotData as exc:
            raise CheckpointError(
                f"the checkpoint holds a {exc}, which a file cannot hold (notes take data only)"
            ) from None
        meta = {
            "format": FORMAT,
            "kind": self.kind,
            "steps": self.steps,
            "total": self.total,
            "saved": time.time(),
            "fingerprint": self.fingerprint,
            "state": state,
            "notes": notes,
        }
        try:
            text = json.dumps(meta, sort_keys=True, allow_nan=True)
        except TypeError as exc:
            raise CheckpointError(f"the checkpoint's fingerprint is not JSON: {exc}") from None
        metadata = {"stopcock": text, "digest": _content_digest(text, encoder.tensors)}
        partial = path.with_name(path.name + ".partial")
        save_file(encoder.tensors, str(partial), metadata=metadata)
        os.replace(partial, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Read a checkpoint written by :meth:`save`; a file that is not one, or that was changed since
        it was written, raises :class:`CheckpointError`. Tensors come back on the CPU."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except SafetensorError as exc:
            raise CheckpointError(
                f"{path} is not a stopcock checkpoint (not a safetensors file: {exc})"
            ) from None
        text = metadata.get("stopcock")
        if text is None:
            raise CheckpointError(f"{path} is a safetensors file but not a stopcock checkpoint")
        if metadata.get("digest") != _content_digest(text, tensors):
            raise CheckpointError(
                f"{path} was modified or damaged after it was saved (its content no longer matches its"
                " digest): refusing it; save the checkpoint again"
            )
        try:
            meta = json.loads(text)
        except ValueError:
            raise CheckpointError(f"{path}: its metadata is not JSON") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise CheckpointError(f"{path} is in format {found!r}; this stopcock reads {FORMAT!r}")
        decoder = _Decoder(tensors)
        return cls(
            kind=str(meta["kind"]),
            steps=int(meta["steps"]),
            total=None if meta["total"] is None else int(meta["total"]),
            fingerprint=meta["fingerprint"],
            state={str(k): decoder.decode(v) for k, v in meta["state"].items()},
            notes=decoder.decode(meta["notes"]),
        )


# -- fingerprints -------------------------------------------------------------------------------------
_SAMPLES = 16  # values sampled from each tensor of a model's state dict



def digest(value: Any) -> str:
    """A short SHA-256 of a JSON-able value (sorted keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def config_data(config: Any) -> dict[str, Any]:
    """A model's or scheduler's config as JSON, without the entries that say where it came from
    (``_name_or_path``, ``_diffusers_version``, ``transformers_version``, ...). Remembered until the
    config's attributes change."""

    def text() -> str:
        items = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        data = json.loads(json.dumps(items, sort_keys=True, default=str))
        return json.dumps(
            {k: v for k, v in data.items() if not k.startswith("_") and k != "transformers_version"}
        )

    key = repr(dict(config)) if isinstance(config, Mapping) else repr(vars(config))
    return dict(json.loads(remembered(config, key, text)))


_remembered: dict[int, tuple[weakref.ref[Any], Any, str]] = {}  # id(obj) -> (obj, key, value)
_remembered_lock = threading.Lock()


def remembered(obj: Any, key: Any, compute: Callable[[], str]) -> str:
    """``compute()`` for ``obj``, done again only when ``key`` (what it depends on) has changed.
    Kept while ``obj`` lives (objects that cannot be referenced weakly are not remembered). Entries
    of objects gone are dropped here, at the next new entry: a weakref callback would run code of
    stopcock's wherever the garbage collector frees the object, in the middle of the user's program."""
    with _remembered_lock:
        found = _remembered.get(id(obj))
    if found is not None and found[0]() is obj and found[1] == key:
        return found[2]
    value = compute()
    try:
        ref = weakref.ref(obj)
    except TypeError:
        return value
    with _remembered_lock:
        for gone in [ident for ident, (r, _, _) in _remembered.items() if r() is None]:
            del _remembered[gone]
        _remembered[id(obj)] = (ref, key, value)
    return value


def vocab_digest(tokenizer: Any) -> str:
    """A digest of a tokenizer's vocabulary (remembered while its size stays the same)."""
    return remembered(tokenizer, len(tokenizer), lambda: digest(sorted(tokenizer.get_vocab().items())))


def _weights_digest(module: torch.nn.Module) -> str:
    """A digest of every tensor's name, shape and dtype and of a fixed sample of its values: it tells
    apart another model, a fine-tune or fused adapter weights, cheaply (not one single changed value).
    Remembered until a tensor is replaced or changed in place (its storage or version counter moves)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    key = tuple((name, t.data_ptr(), t._version, t.shape, t.dtype, t.device) for name, t in tensors)
    return remembered(module, key, lambda: _sampled_digest(module))


def _sampled_digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=False).items():
            h.update(f"\0{name}\0{tuple(t.shape)}\0{t.dtype}\0".encode())
            if t.numel() and t.device.type != "meta":
                flat = t.detach().reshape(-1)
                index = torch.linspace(0, flat.numel() - 1, min(_SAMPLES, flat.numel())).long()
                sample = flat[index.to(flat.device)].to("cpu", torch.float64)
                h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def model_fingerprint(module: torch.nn.Module, device: Any = None) -> dict[str, Any]:
    """Class, config, weights digest, dtype, and the device it computes on (``device``, else its weights')."""
    first = next(module.parameters(), None)
    found: dict[str, Any] = {"class": type(module).__name__, "weights": _weights_digest(module)}
    config = getattr(module, "config", None)
    if config is not None:
        found["config"] = config_data(config)
    if first is not None:
        found["dtype"] = str(first.dtype).removeprefix("torch.")
        found["device"] = str(device if device is not None else first.device)
    return found


def _differences(saved: Any, current: Any, where: str) -> Iterator[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(saved.keys() | current.keys(), key=str):
            here = f"{where}.{key}" if where else str(key)
            if key not in current:
                yield f"{here}: in the checkpoint only ({_short(saved[key])})"
            elif key not in saved:
                yield f"{here}: in this target only ({_short(current[key])})"
            else:
                yield from _differences(saved[key], current[key], here)
    elif saved != current:
        yield f"{where}: {_short(saved)} in the checkpoint, {_short(current)} here"


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def check_fingerprint(checkpoint: Checkpoint, current: dict[str, Any]) -> None:
    """Raise :class:`CheckpointMismatch` naming every difference between the checkpoint's fingerprint
    and ``current`` (the target's, computed the same way)."""
    found = list(_differences(checkpoint.fingerprint, json.loads(json.dumps(current, default=str)), ""))
    if found:
        shown = "; ".join(found[:8]) + (f"; and {len(found) - 8} more" if len(found) > 8 else "")
        raise CheckpointMismatch(
            f"this {checkpoint.describe()} does not match the target given to resume ({shown}): resume"
            " it with the same model, pipeline, scheduler, dtype and device, and the same library"
            " versions"
        )


def rng_state() -> dict[str, Any]:
    """torch's global RNG state now: the CPU's, and each CUDA device's once CUDA is in use."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put torch's global RNG back where :func:`rng_state` found it."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(list(state["cuda"]))
