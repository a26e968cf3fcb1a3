"""The checkpoint file: typed values round-trip, loading runs no code (nothing unpickled, no class it
names is built but the adapter's own), a modified or foreign file is refused, and a resume on another
target than the checkpoint's is refused naming what differs. Plus the interception it relies on."""

from __future__ import annotations

import json
import struct
import threading

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import EulerDiscreteScheduler

import stopcock
from stopcock.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointMismatch,
    GeneratorState,
    Live,
    ObjectState,
)
from stopcock.intercept import COMPUTE, answering, intercepted
from tiny import image as tiny


def test_typed_values_round_trip(tmp_path):
    generator = torch.Generator().manual_seed(5)
    image = PIL.Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    state = {
        "tensors": [
            torch.tensor(3.5),
            torch.zeros(0),
            torch.ones(2, dtype=torch.bfloat16),
            torch.tensor([True]),
        ],
        "nested": {1: ("a", None, 2.5, False), "dtype": torch.float16, "device": torch.device("cpu")},
        "generator": GeneratorState.of(generator),
        "object": ObjectState("Thing", {"x": torch.arange(3), "n": 4}),
        "image": image,
        "array": np.array([[1.5, 2.5]]),
    }
    saved = Checkpoint("diffusers", 3, 10, {"target": "X"}, state, notes={"who": "me"})
    loaded = Checkpoint.load(saved.save(tmp_path / "c.safetensors"))
    assert (loaded.kind, loaded.steps, loaded.total, loaded.notes) == ("diffusers", 3, 10, {"who": "me"})
    got = loaded.state
    for a, b in zip(got["tensors"], state["tensors"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got["nested"] == state["nested"]
    assert torch.equal(got["generator"].generator().get_state(), generator.get_state())
    assert got["object"].cls == "Thing" and torch.equal(got["object"].attributes["x"], torch.arange(3))
    assert np.array_equal(np.asarray(got["image"]), np.asarray(image)) and got["image"].mode == "RGB"
    assert np.array_equal(got["array"], state["array"])


def _file_parts(path):
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    return data, size, json.loads(data[8 : 8 + size])


def test_a_file_changed_after_saving_is_refused(tmp_path):
    path = Checkpoint("diffusers", 1, 2, {}, {"x": torch.arange(8.0)}).save(tmp_path / "c.safetensors")
    data, size, header = _file_parts(path)
    flipped = bytearray(data)
    flipped[-3] ^= 0xFF  # a byte of the tensor data
    (tmp_path / "tensor.safetensors").write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="modified or damaged"):
        Checkpoint.load(tmp_path / "tensor.safetensors")
    meta = json.loads(header["__metadata__"]["stopcock"])
    meta["steps"] = 2  # a plausible edit of the JSON, e.g. to skip a step
    header["__metadata__"]["stopcock"] = json.dumps(meta, sort_keys=True)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (tmp_path / "meta.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + data[8 + size :])
    with pytest.raises(CheckpointError, match="modified or damaged"):
        Checkpoint.load(tmp_path / "meta.safetensors")


def test_files_that_are_not_checkpoints_are_refused(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "junk").write_bytes(b"\x80\x04\x95 this is a pickle, not a checkpoint")
    with pytest.raises(CheckpointError, match="not a stopcock checkpoint"):
        Checkpoint.load(tmp_path / "junk")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "weights.safetensors"))
    with pytest.raises(CheckpointError, match="not a stopcock checkpoint"):
        Checkpoint.load(tmp_path / "weights.safetensors")


def test_loading_builds_no_class_the_file_names(text_model, batch_ids, tmp_path):
    """A file may name any class; only transformers' cache classes are ever built from it."""
    stopped = stopcock.run(
        text_model, batch_ids, max_new_tokens=6, do_sample=False, stop=stopcock.max_steps(2), checkpoint=True
    )
    stopped.checkpoint.state["generate"]["cache"] = ObjectState(
        "Popen", {"args": ["touch", str(tmp_path / "x")]}
    )
    loaded = Checkpoint.load(stopped.checkpoint.save(tmp_path / "evil.safetensors"))
    with pytest.raises(CheckpointError, match="'Popen', not a transformers cache class"):
        stopcock.resume(text_model, loaded)
    assert not (tmp_path / "x").exists()


@pytest.fixture
def batch_ids(tokenizer):
    return tokenizer(["Once upon"], return_tensors="pt").input_ids


@pytest.fixture(scope="module")
def sd_checkpoint():
    pipe = tiny.stable_diffusion_pipeline()
    outcome = stopcock.run(
        pipe,
        "a cat",
        num_inference_steps=4,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
        stop=stopcock.max_steps(2),
        checkpoint=True,
    )
    return outcome.checkpoint


def test_another_model_is_refused_naming_what_differs(sd_checkpoint):
    with pytest.raises(CheckpointMismatch, match=r"components\.unet\.weights"):
        stopcock.resume(tiny.stable_diffusion_pipeline(seed=1), sd_checkpoint)
    other = tiny.stable_diffusion_pipeline()
    other.scheduler = EulerDiscreteScheduler.from_config(other.scheduler.config)
    with pytest.raises(
        CheckpointMismatch, match=r"components\.scheduler\.class: \"DDIMScheduler\" in the checkpoint"
    ):
        stopcock.resume(other, sd_checkpoint)
    with pytest.raises(CheckpointMismatch, match=r"dtype: \"float32\" in the checkpoint, \"float64\" here"):
        stopcock.resume(tiny.stable_diffusion_pipeline().to(dtype=torch.float64), sd_checkpoint)
    with pytest.raises(CheckpointMismatch, match='target: "StableDiffusionPipeline" in the checkpoint'):
        stopcock.resume(tiny.semantic_pipeline(), sd_checkpoint)


def test_other_library_versions_are_refused(sd_checkpoint):
    changed = Checkpoint(
        **{**sd_checkpoint.__dict__, "fingerprint": json.loads(json.dumps(sd_checkpoint.fingerprint))}
    )
    changed.fingerprint["versions"]["diffusers"] = "0.1.0"
    with pytest.raises(CheckpointMismatch, match=r"versions\.diffusers: \"0\.1\.0\" in the checkpoint"):
        stopcock.resume(tiny.stable_diffusion_pipeline(), changed)


def test_a_checkpoint_of_another_library_is_refused(sd_checkpoint, text_model):
    with pytest.raises(CheckpointMismatch, match="diffusers checkpoint of a StableDiffusionPipeline"):
        stopcock.resume(text_model, sd_checkpoint)
    with pytest.raises(TypeError, match=r"takes a stopcock\.Checkpoint"):
        stopcock.resume(text_model, "checkpoint.safetensors")


def test_checkpoint_takes_a_bool_and_names_the_live_arguments(text_model, batch_ids):
    with pytest.raises(TypeError, match="checkpoint= takes True or False"):
        stopcock.run(text_model, batch_ids, max_new_tokens=2, checkpoint="yes")
    assert Checkpoint(
        "x", 0, None, {}, {"call": {"args": [], "kwargs": {"cb": Live("cb", "function")}}}
    ).live == ["cb"]


# -- interception ------------------------------------------------------------------------------------
class Model(torch.nn.Module):
    def forward(self, x):
        return x + 1


def test_interception_is_per_thread_and_leaves_the_class_as_it_was():
    model = Model()
    inside, release = threading.Event(), threading.Event()
    seen = {}

    def other_thread():
        with intercepted(model, "__call__", lambda call, x: call(x) * 10):
            seen["other"] = model(torch.tensor(1.0))
            inside.set()
            release.wait()

    thread = threading.Thread(target=other_thread)
    thread.start()
    inside.wait()

    class Source:
        def answer(self, module, args, kwargs):
            return torch.tensor(-1.0) if args[0] > 5 else COMPUTE

        def observe(self, module, args, kwargs, output):
            seen.setdefault("observed", []).append(output)

    with answering([model], Source()):
        assert model(torch.tensor(9.0)) == -1  # answered: no forward
        assert model(torch.tensor(1.0)) == 2
    assert seen["other"] == 20 and seen["observed"] == [2]
    assert type(model).__name__ == "Model" and model(torch.tensor(1.0)) == 2  # this thread: the original
    release.set()
    thread.join()
    assert type(model) is Model and "_stopcock_intercepted" not in vars(model)


def test_replay_checks_each_call_and_the_latents_it_reaches(sd_checkpoint):
    """Guards past the fingerprint: a replayed call unlike the recorded one, or latents at the
    checkpoint's step other than the saved ones, stop the resume with a CheckpointMismatch."""
    pipe = tiny.stable_diffusion_pipeline()
    calls = [[dict(call) for call in step] for step in sd_checkpoint.state["calls"]]
    calls[1][0]["inputs"] = calls[1][0]["inputs"].replace("float32", "float16", 1)
    other = Checkpoint(**{**sd_checkpoint.__dict__, "state": {**sd_checkpoint.state, "calls": calls}})
    with pytest.raises(
        CheckpointMismatch, match=r"loop model call 2 is unet\(.*float32.*the checkpoint's is unet"
    ):
        stopcock.resume(pipe, other)
    moved = {**sd_checkpoint.state, "latents": sd_checkpoint.state["latents"] + 1}
    with pytest.raises(CheckpointMismatch, match="replaying 2 steps did not give the checkpoint's latents"):
        stopcock.resume(pipe, Checkpoint(**{**sd_checkpoint.__dict__, "state": moved}))
    assert type(pipe.unet).__name__ == "UNet2DConditionModel" and "_stopcock_intercepted" not in vars(
        pipe.unet
    )


def test_versions_name_the_targets_libraries_and_their_numeric_dependencies(text_model):
    """Read from the installed packages: the target's library and its dependencies that decide
    numbers, not other libraries imported here (diffusers is, by this module), nor tools (tqdm)."""
    import importlib.metadata

    from stopcock.checkpoint import versions

    found = versions(text_model)
    assert {"torch", "stopcock", "transformers", "tokenizers", "safetensors", "numpy"} <= set(found)
    assert "diffusers" not in found and "tqdm" not in found and "huggingface-hub" not in found
    assert found["transformers"] == importlib.metadata.version("transformers")
    assert set(versions()) == {"torch", "stopcock"}  # user code's own classes name no library
    pipe = tiny.ddpm_pipeline()
    image = versions(pipe, *pipe.components.values())
    assert "diffusers" in image and "transformers" not in image  # no transformers part in this pipeline


def test_a_library_named_as_its_module_is_found_without_mapping_every_distribution(text_model):
    """The first checkpoint of a process (a served job's first stop) must not read the file lists of
    every installed distribution; a module named otherwise than its distribution still is found."""
    import importlib.metadata

    import PIL.Image

    from stopcock import versions as checkpoint

    checkpoint._distributions.cache_clear()
    checkpoint._named_after.cache_clear()
    pipe = tiny.ddpm_pipeline()
    assert checkpoint._library_of(text_model) == "transformers"
    assert checkpoint._library_of(pipe.unet) == "diffusers"
    assert checkpoint._distributions.cache_info().misses == 0  # the full mapping was never built
    assert checkpoint._library_of(PIL.Image.new("RGB", (1, 1))) == "pillow"  # module PIL: the mapping
    assert checkpoint._distributions.cache_info().misses == 1
    mapped = importlib.metadata.packages_distributions()
    assert mapped["transformers"] == ["transformers"] and mapped["diffusers"] == ["diffusers"]
