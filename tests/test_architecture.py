"""The package's seams: layering without circles, the adapter registry, run()'s collision-free
``kwargs=``, explicit adapters, and the shared helpers each mechanism has once."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import stopcock
from stopcock._callbacks import Callbacks
from stopcock.adapters import REGISTRY
from stopcock.conditions import AnyOf, from_options, refuse_row_conditions, stop_strings_of
from stopcock.outcome import Outcome
from stopcock.state import StepState
from tiny import image as tiny

PACKAGE = Path(stopcock.__file__).parent
TOP = ("stopcock.cli", "stopcock.server", "stopcock.demo", "stopcock.lint")  # the layers over the core


def _imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in the file, lazy imports included)."""
    modules = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                found |= {base, *(f"{base}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        edges[name] = {m for m in found if m in modules and m != name}
    return edges


def test_no_import_circles_and_no_import_from_the_core_up():
    edges = _imports()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                if nxt == goal:
                    return True
                seen.add(nxt)
                todo.append(nxt)
        return False

    circles = sorted(m for m in edges if reaches(m, m))
    assert circles == []
    upward = sorted(
        (a, b) for a, targets in edges.items() for b in targets
        if not a.startswith(TOP) and a not in ("stopcock", "stopcock.__main__") and b.startswith(TOP)
    )
    assert upward == []


def test_the_registry_states_each_adapters_options_and_names():
    for entry in REGISTRY:
        adapter = entry.load()
        assert (adapter.name, adapter.options) == (entry.name, entry.options)


def test_the_run_module_names_no_adapter_option():
    source = (PACKAGE / "runner.py").read_text()
    for entry in REGISTRY:
        for option in entry.options:
            assert f'"{option}"' not in source


class _ModePipeline:
    """A real Stable Diffusion pipeline whose call also takes a ``mode`` (as WanAnimatePipeline does)."""

    @staticmethod
    def build():
        from diffusers import StableDiffusionPipeline

        class ModePipeline(StableDiffusionPipeline):
            def __call__(self, *args, mode: str = "animate", **kwargs):
                self.called_with_mode = mode
                return super().__call__(*args, **kwargs)

        pipe = ModePipeline(**tiny.stable_diffusion_pipeline().components)
        pipe.set_progress_bar_config(disable=True)
        return pipe


def test_a_target_argument_named_like_a_run_option_goes_through_kwargs():
    pipe = _ModePipeline.build()
    outcome = stopcock.run(
        pipe, "a cat", num_inference_steps=3, output_type="np", mode="abort",
        stop=stopcock.max_steps(1), kwargs={"mode": "replace"},
    )
    assert pipe.called_with_mode == "replace"
    assert outcome.stopped and outcome.mode == "abort" and outcome.steps == 1
    with pytest.raises(ValueError, match=r"kwargs=\{'mode'"):
        stopcock.run(pipe, "a cat", mode="replace")
    with pytest.raises(TypeError, match="given both"):
        stopcock.run(pipe, "a cat", num_inference_steps=2, kwargs={"num_inference_steps": 3})
    with pytest.raises(TypeError, match="mapping"):
        stopcock.run(pipe, "a cat", kwargs=[("mode", "replace")])


def test_an_adapter_option_for_the_target_itself_goes_through_kwargs(text_model, tokenizer):
    batch = tokenizer(["hello"], return_tensors="pt")
    with pytest.raises(TypeError, match=r"kwargs=\{'partial'"):
        stopcock.run(text_model, **batch, partial="raw")
    with pytest.raises(ValueError, match="partial"):  # generate itself refuses an argument it does not use
        stopcock.run(text_model, **batch, max_new_tokens=2, kwargs={"partial": "raw"})


def test_a_run_can_name_its_adapter(text_model, tokenizer):
    batch = tokenizer(["hello"], return_tensors="pt")
    outcome = stopcock.run(text_model, **batch, max_new_tokens=2, adapter="transformers")
    assert outcome.steps == 2
    with pytest.raises(stopcock.UnsupportedTarget, match="diffusers"):
        stopcock.run(text_model, **batch, adapter="diffusers")
    with pytest.raises(ValueError, match="adapter must be"):
        stopcock.run(text_model, **batch, adapter="vllm")
    adapter = REGISTRY[0].load()
    assert stopcock.run(text_model, **batch, max_new_tokens=1, adapter=adapter).steps == 1


def test_streams_take_the_same_run_options(text_model, tokenizer):
    batch = tokenizer(["hello"], return_tensors="pt")
    with stopcock.stream(text_model, **batch, max_new_tokens=3, adapter="transformers", mode="abort",
                         tokenizer=tokenizer) as events:
        done = list(events)[-1]
    assert isinstance(done, stopcock.Done) and done.outcome.mode == "abort" and done.outcome.steps == 3
    with pytest.raises(ValueError, match="preview="):
        stopcock.stream(text_model, **batch, tokenizer=tokenizer, preview="latent")


def test_row_conditions_are_found_and_refused_in_one_place():
    signal = stopcock.StopSignal()
    assert stop_strings_of(AnyOf(signal, stopcock.stop_strings(["a", "b"]))) == ["a", "b"]
    assert stop_strings_of(stopcock.stop_strings("x")) == ["x"]
    assert stop_strings_of(stopcock.timeout(1)) == [] and stop_strings_of(None) == []
    with pytest.raises(ValueError, match=r"\|"):
        stop_strings_of(stopcock.stop_strings(["a"]) & stopcock.max_steps(1))
    refuse_row_conditions(stopcock.timeout(1) | signal, "images")
    with pytest.raises(ValueError, match="not to images; remove it"):
        refuse_row_conditions(signal | stopcock.stop_strings(["a"]), "images", "remove it")
    assert stopcock.stop_strings(["a"]).check(StepState()) is None  # a row condition never fires alone


def test_conditions_from_an_options_mapping():
    found = from_options({"timeout": 2, "max_steps": 3, "stop_strings": None, "deadline": None})
    assert [repr(c) for c in found] == ["timeout(2)", "max_steps(3)"]
    assert from_options({}) == [] and from_options({"stop_strings": []}) == []
    with pytest.raises(ValueError, match="unknown stop option"):
        from_options({"time_out": 1})
    with pytest.raises(ValueError, match="timeout"):
        from_options({"timeout": -1})


def test_an_outcome_without_output_keeps_the_last_step():
    last = StepState(step=4, total=10, latents=torch.zeros(1), input_ids=torch.ones(1, 3))
    outcome = Outcome.without_output(last, reason="interrupted", mode="abort", detail="gone")
    assert (outcome.stopped, outcome.steps, outcome.total_steps, outcome.output) == (True, 4, 10, None)
    assert outcome.latents is last.latents and outcome.extra["input_ids"] is last.input_ids
    never = Outcome.without_output(None, reason="shutdown", detail="never ran")
    assert (never.steps, never.total_steps, never.extra, never.mode) == (0, None, {}, "finish")
    assert "stopped (shutdown) after 0 steps" in never.describe()


def test_callbacks_remove_each_registration_on_its_own():
    import threading

    seen: list[str] = []
    callbacks = Callbacks(threading.RLock())
    fn = lambda: seen.append("x")  # noqa: E731
    remove_first = callbacks.add(fn)
    callbacks.add(fn)
    remove_first()
    remove_first()  # idempotent
    for cb in callbacks.snapshot():
        cb()
    assert seen == ["x"]
    assert len(callbacks.drain()) == 1 and callbacks.snapshot() == []


def test_the_stream_types_are_exported():
    for name in ("Stream", "AsyncStream", "TextChunk", "Step", "Done", "Event"):
        assert name in stopcock.__all__ and getattr(stopcock, name) is not None


def test_a_class_swap_builds_its_subclass_with_the_classs_own_metaclass():
    from diffusers import StableDiffusionPipeline

    from stopcock.intercept import subclass

    meta = type("Meta", (type(StableDiffusionPipeline),), {})
    custom = meta("CustomPipeline", (StableDiffusionPipeline,), {"__module__": __name__})
    made = subclass(custom, "probe", lambda: {"probe": True})
    assert type(made) is meta and made.__name__ == "CustomPipeline" and made.probe
    assert subclass(custom, "probe", lambda: {}) is made  # made once per class and key

    pipe = custom(**tiny.stable_diffusion_pipeline().components)
    assert stopcock.guard(pipe) is pipe and type(type(pipe)) is meta and isinstance(pipe, custom)
    with pytest.raises(TypeError, match=r"stopping_criteria.*stop="):
        pipe("a cat", num_inference_steps=1, stopping_criteria=[])


def test_a_method_bound_for_a_thread_leaves_other_threads_and_comes_off():
    import threading

    from stopcock.binding import bound

    class Counter:
        def value(self) -> int:
            return 1

    counter = Counter()
    seen: list[int] = []
    with bound(counter, "value", lambda original: lambda: original() + 10):
        with bound(counter, "value", lambda original: lambda: original() + 100):
            seen.append(counter.value())
        seen.append(counter.value())
        other = threading.Thread(target=lambda: seen.append(counter.value()))
        other.start()
        other.join(timeout=10)
    assert seen == [111, 11, 1] and "value" not in vars(counter) and counter.value() == 1


def test_library_helpers_have_their_namespaces_and_keep_their_top_level_names():
    import stopcock.diffusers
    import stopcock.transformers

    assert stopcock.transformers.stopping_criteria is stopcock.stopping_criteria
    for name in ("step_callback", "attach", "guard"):
        assert getattr(stopcock.diffusers, name) is getattr(stopcock, name)


MAX_CLASS_LINES, MAX_MODULE_LINES = 200, 600
#: Still over the limits, each with the most lines it may have until it is split: an entry may only
#: shrink, and goes once its class or module fits.
NOT_SPLIT_YET: dict[str, int] = {
    "stopcock.control.RunControl": 278,
    "stopcock.server.engine.LocalEngine": 307,
}


def _sizes() -> tuple[dict[str, int], dict[str, int]]:
    """The lines of each module of the package (by dotted name) and of each class (``module.Class``)."""
    modules, classes = {}, {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        source = path.read_text()
        modules[module] = len(source.splitlines())
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                classes[f"{module}.{node.name}"] = node.end_lineno - node.lineno + 1
    return modules, classes


def test_no_class_over_200_lines_and_no_module_over_600():
    modules, classes = _sizes()
    over = {name: n for name, n in modules.items() if n > MAX_MODULE_LINES}
    over |= {name: n for name, n in classes.items() if n > MAX_CLASS_LINES}
    grown = {name: n for name, n in over.items() if n > NOT_SPLIT_YET.get(name, 0)}
    assert grown == {}
    assert sorted(name for name in NOT_SPLIT_YET if name not in over) == []  # split: take it off the list
