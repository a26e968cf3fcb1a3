"""Facts about stopping diffusers and transformers that the runtime adapters and the linter share.

One source of truth, read the same way at run time (from a class object) and at lint time (from a
class name, in the installed diffusers' source, without importing diffusers). Importing this module
imports nothing heavy: no torch, diffusers or transformers.

- :data:`GENERATE_ONLY`: transformers ``generate()`` arguments that diffusers pipelines ignore (those
  taking ``**kwargs``) or reject.
- :data:`OTHER_ENGINE_ARGS`: argument names of other engines (vLLM, OpenAI, TGI, llama.cpp, Ollama)
  that transformers ``generate()`` does not know, with the transformers spelling.
- :func:`call_honours_interrupt` / :func:`pipeline_class`: whether a pipeline's denoising loop reads
  its interrupt flag at every step, decided by static analysis of the source of its ``__call__``.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import os
import re
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "GENERATE_ONLY",
    "OTHER_ENGINE_ARGS",
    "PipelineClass",
    "call_honours_interrupt",
    "function_honours_interrupt",
    "is_generic_pipeline_name",
    "is_pipeline_class_name",
    "pipeline_class",
]

#: transformers generate() arguments that diffusers pipelines ignore (those taking **kwargs) or reject.
GENERATE_ONLY = frozenset(
    {
        "stopping_criteria",
        "logits_processor",
        "max_new_tokens",
        "min_new_tokens",
        "max_length",
        "max_time",
        "stop_strings",
        "streamer",
        "generation_config",
        "eos_token_id",
    }
)

#: Names other engines use that transformers generate() does not know, with what transformers calls
#: it. generate() hands unknown names to the model and refuses them only when the call runs.
OTHER_ENGINE_ARGS: dict[str, str] = {
    "max_tokens": "max_new_tokens=",
    "max_completion_tokens": "max_new_tokens=",
    "max_output_tokens": "max_new_tokens=",
    "num_predict": "max_new_tokens=",
    "min_tokens": "min_new_tokens=",
    "stop": "stop_strings=[...] together with tokenizer=",
    "stop_sequences": "stop_strings=[...] together with tokenizer=",
    "stop_token_ids": "eos_token_id=[...]",
    "ignore_eos": "min_new_tokens= (transformers has no switch to ignore the eos token)",
    "n": "num_return_sequences=",
    "best_of": "num_beams= with num_return_sequences=",
    "presence_penalty": "repetition_penalty= (a different, multiplicative penalty)",
    "frequency_penalty": "repetition_penalty= (a different, multiplicative penalty)",
    "logprobs": "output_scores=True, return_dict_in_generate=True",
    "stream": "streamer= (a TextIteratorStreamer)",
}

Function = ast.FunctionDef | ast.AsyncFunctionDef

# Names of diffusers pipeline classes whose concrete class is only known at run time.
GENERIC_PIPELINES = frozenset({"DiffusionPipeline"})


def is_pipeline_class_name(name: str) -> bool:
    """Whether ``name``, imported from diffusers, names a (non-modular) pipeline class."""
    if name in GENERIC_PIPELINES or name.startswith("AutoPipelineFor"):
        return True
    return (
        "Pipeline" in name
        and "Modular" not in name
        and not name.endswith(("Output", "Blocks", "Config", "Callback", "Callbacks", "Mixin"))
    )


def is_generic_pipeline_name(name: str) -> bool:
    """Whether ``name`` (a pipeline class name) leaves the concrete class to run time."""
    return name in GENERIC_PIPELINES or name.startswith("AutoPipelineFor")


# -- does the denoising loop honour the interrupt flag? ---------------------------------------------
_FLAGS = ("interrupt", "_interrupt")


def _reads_flag(test: ast.expr) -> bool:
    """``self.interrupt`` / ``self._interrupt``, alone or in an ``or``."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
        return any(_reads_flag(value) for value in test.values)
    return (
        isinstance(test, ast.Attribute)
        and test.attr in _FLAGS
        and isinstance(test.value, ast.Name)
        and test.value.id == "self"
    )


_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def _outermost_loops(body: list[ast.stmt]) -> Iterator[ast.For | ast.AsyncFor | ast.While]:
    """The loops of a function body that no other loop encloses (nested functions excluded)."""
    for stmt in body:
        if isinstance(stmt, _LOOPS):
            yield stmt
        elif not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for child in getattr(stmt, field, ()):
                    if isinstance(child, (ast.ExceptHandler, ast.match_case)):
                        yield from _outermost_loops(child.body)
                    else:
                        yield from _outermost_loops([child])


def _checks_flag(loop: ast.For | ast.AsyncFor | ast.While) -> bool:
    """Whether a top-level statement of the loop's body is ``if self.interrupt: continue`` (or ``break``)."""
    return any(
        isinstance(stmt, ast.If)
        and _reads_flag(stmt.test)
        and any(isinstance(s, (ast.Continue, ast.Break)) for s in stmt.body)
        for stmt in loop.body
    )


def _nodes_outside_loops(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """The nodes of ``body`` that no loop, nested function or comprehension encloses."""
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(
            node,
            (
                ast.For,
                ast.AsyncFor,
                ast.While,
                ast.FunctionDef,
                ast.AsyncFunctionDef,
                ast.ClassDef,
                ast.Lambda,
                ast.comprehension,
            ),
        ):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def function_honours_interrupt(
    function: Function, method: Callable[[str], Function | None] | None = None
) -> bool:
    """Whether a pipeline's ``__call__`` checks its interrupt flag at every step of its denoising loop.

    The denoising loop is the innermost loop whose body has ``if self.interrupt: continue`` (or
    ``break``) among its top-level statements. True when that loop is not inside another loop, in the
    ``__call__`` or in a method it calls outside any loop (``self.denoise(...)``, looked up with
    ``method``). A check only in an inner loop (AnimateDiff's free-init, SkyReels-V2's diffusion
    forcing, Framepack, ...) does not count: the outer loop keeps working after the flag is set.
    """
    for loop in _outermost_loops(function.body):
        inner = (n for n in ast.walk(loop) if n is not loop and isinstance(n, _LOOPS))
        if _checks_flag(loop) and not any(_checks_flag(n) for n in inner):
            return True
    if method is None:
        return False
    for node in _nodes_outside_loops(function.body):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
        ):
            helper = method(node.func.attr)
            if helper is not None and helper is not function and function_honours_interrupt(helper):
                return True
    return False


def _resets_flag(function: Function) -> bool:
    """Whether the function sets ``self._interrupt = False`` (at the start of every call, in diffusers)."""
    return any(
        isinstance(node, ast.Assign)
        and any(
            isinstance(t, ast.Attribute)
            and t.attr == "_interrupt"
            and isinstance(t.value, ast.Name)
            and t.value.id == "self"
            for t in node.targets
        )
        and isinstance(node.value, ast.Constant)
        and node.value.value is False
        for node in ast.walk(function)
    )


@functools.cache
def _parsed_function(function: object) -> Function | None:
    """The ast of a function from its source (decorators such as ``torch.no_grad()`` unwrapped), or None."""
    if not callable(function) or not inspect.isfunction(inspect.unwrap(function)):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):  # no source: built dynamically, typed into a REPL, .pyc only
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


@functools.cache
def call_honours_interrupt(cls: type) -> bool:
    """Whether the ``__call__`` that ``cls`` itself defines checks the interrupt flag at every step.

    From the class object, at run time (see :func:`function_honours_interrupt`); methods it calls are
    looked up on ``cls``. A class without its own ``__call__``, or whose source cannot be read, answers
    False.
    """
    call = _parsed_function(vars(cls).get("__call__"))
    if call is None:
        return False

    def method(name: str) -> Function | None:
        return _parsed_function(inspect.getattr_static(cls, name, None))

    return function_honours_interrupt(call, method)


# -- lint time: a class name, looked up in the installed diffusers' source ---------------------------
@dataclass(frozen=True)
class PipelineClass:
    """What the installed diffusers' source says about one pipeline class (see :func:`pipeline_class`)."""

    name: str
    file: Path
    call_defined_in: str | None  # the class whose __call__ runs (this one, or a base); None: no __call__
    honours_interrupt: bool
    resets_interrupt: bool
    parameters: frozenset[str]  # the __call__'s named parameters
    var_kwargs: bool  # __call__ takes **kwargs (unknown names are swallowed, not refused)
    tensor_inputs_default: tuple[str, ...] | None  # callback_on_step_end_tensor_inputs' default


_CLASS_LINE = re.compile(rb"^class[ \t]+(\w+)[ \t]*[(:]", re.M)


@functools.cache
def _diffusers_root() -> Path | None:
    """The installed diffusers package folder, found without importing it."""
    try:
        spec = importlib.util.find_spec("diffusers")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    return Path(locations[0]) if locations else None


@functools.cache
def _class_index() -> dict[str, Path]:
    """Class name -> the file under ``diffusers/pipelines/`` that defines it (empty without diffusers)."""
    root = _diffusers_root()
    index: dict[str, Path] = {}
    if root is None:
        return index
    for folder, _dirs, files in os.walk(root / "pipelines"):
        for name in sorted(files):
            if name.endswith(".py"):
                path = Path(folder, name)
                for match in _CLASS_LINE.finditer(path.read_bytes()):
                    index.setdefault(match.group(1).decode(), path)
    return index


@functools.cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text("utf-8"), str(path))


def _base_names(node: ast.ClassDef) -> list[str]:
    names = []
    for base in node.bases:
        if isinstance(base, ast.Name):
            names.append(base.id)
        elif isinstance(base, ast.Attribute):
            names.append(base.attr)
    return names


def _find_method(class_name: str, method: str, depth: int = 0) -> tuple[str, Function] | None:
    """The class defining ``method`` (``class_name`` or a base, depth first, left to right) and the method."""
    path = _class_index().get(class_name)
    if path is None or depth > 8:
        return None
    node = next((n for n in _parsed(path).body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if node is None:
        return None
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == method:
            return class_name, stmt
    for base in _base_names(node):
        found = _find_method(base, method, depth + 1)
        if found is not None:
            return found
    return None


def _tensor_inputs_default(function: Function) -> tuple[str, ...] | None:
    args = function.args
    positional = args.posonlyargs + args.args
    with_default = positional[len(positional) - len(args.defaults) :]
    defaults = {a.arg: d for a, d in zip(with_default, args.defaults, strict=True)}
    defaults |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None}
    default = defaults.get("callback_on_step_end_tensor_inputs")
    if not isinstance(default, (ast.List, ast.Tuple)):
        return None
    names = [e.value for e in default.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return tuple(names) if len(names) == len(default.elts) else None


def _method_of(class_name: str, method: str) -> Function | None:
    found = _find_method(class_name, method)
    return found[1] if found is not None else None


@functools.cache
def pipeline_class(name: str) -> PipelineClass | None:
    """What the installed diffusers' source says about the pipeline class ``name``, or None.

    None when diffusers is not installed or defines no such class under ``diffusers/pipelines/``.
    The file is found by its ``class Name(`` line; nothing is imported.
    """
    path = _class_index().get(name)
    if path is None:
        return None
    found = _find_method(name, "__call__")
    if found is None:
        return PipelineClass(name, path, None, False, False, frozenset(), False, None)
    owner, function = found
    args = function.args
    parameters = frozenset(a.arg for a in args.posonlyargs + args.args + args.kwonlyargs) - {"self"}
    return PipelineClass(
        name=name,
        file=path,
        call_defined_in=owner,
        honours_interrupt=function_honours_interrupt(function, lambda method: _method_of(name, method)),
        resets_interrupt=_resets_flag(function),
        parameters=parameters,
        var_kwargs=args.kwarg is not None,
        tensor_inputs_default=_tensor_inputs_default(function),
    )
