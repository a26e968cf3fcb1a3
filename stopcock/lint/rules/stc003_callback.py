"""STC003: a ``callback_on_step_end`` that breaks diffusers' callback contract."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ...pipeline_facts import pipeline_class
from ..engine import Finding, Module, Rule, keyword, returns_value, walk_function
from ..resolve import FunctionNode

DEFAULT_TENSOR_INPUTS = ("latents",)  # the default of callback_on_step_end_tensor_inputs in diffusers


class CallbackContract(Rule):
    code = "STC003"
    name = "callback-contract"
    summary = "a `callback_on_step_end` that can return None, or reads tensors the call never declares"
    explanation = """
        Diffusers calls `callback_on_step_end(pipe, step, timestep, callback_kwargs)` at the end of
        every step and pops the tensors back out of what it returns (`callback_outputs.pop("latents",
        latents)`, 199 of 201 call sites in diffusers 0.42.1): a callback that ends a path without
        `return callback_kwargs` crashes the run with `AttributeError: 'NoneType' object has no attribute
        'pop'`, typically on the path that was meant to stop it.

        `callback_kwargs` holds only the tensors named in `callback_on_step_end_tensor_inputs`
        (default `["latents"]`; a `PipelineCallback` declares its own `tensor_inputs`): reading
        `callback_kwargs["prompt_embeds"]` without declaring it raises `KeyError` at the first step.
        Checked where the call's list is literal (or the default) and the callback is defined in the file.
        """
    wrong = """
        def stop_early(pipe, step, timestep, callback_kwargs):
            if step == 10:
                pipe._interrupt = True
                return                      # diffusers pops from None: AttributeError
            embeds = callback_kwargs["prompt_embeds"]   # not declared below: KeyError
            return callback_kwargs

        pipe("a cat", callback_on_step_end=stop_early)
        """
    right = """
        def stop_early(pipe, step, timestep, callback_kwargs):
            if step == 10:
                pipe._interrupt = True
            embeds = callback_kwargs["prompt_embeds"]
            return callback_kwargs

        pipe("a cat", callback_on_step_end=stop_early,
             callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"])
        """
    upstream = (
        "huggingface/diffusers#5427: the PR that added `callback_on_step_end`; the pipeline pops the"
        " callback's return value and passes only the declared tensor inputs",
        "vladmandic/sdnext#5059: `callback_on_step_end(self, i, t, callback_kwargs)` failing with"
        " `KeyError: 'latents'` for tensors the pipeline did not pass",
    )

    def check(self, module: Module) -> Iterator[Finding]:
        reported: set[FunctionNode] = set()
        for call, _kw, function in module.callback_sites():
            kwargs_name = _kwargs_parameter(function, 4)
            if function not in reported and kwargs_name is not None and not returns_value(function):
                reported.add(function)
                yield self._no_return(module, function, kwargs_name)
            declared = self._declared(module, call)
            read = _read_keys(function, kwargs_name) if kwargs_name is not None else {}
            missing = {
                key: node for key, node in read.items() if declared is not None and key not in declared
            }
            if missing:
                keys = ", ".join(repr(k) for k in sorted(missing))
                first = min(getattr(n, "lineno", 0) for n in missing.values())
                yield module.finding(
                    self,
                    call,
                    f"{function.name} reads callback_kwargs[{keys}] (line {first})"
                    f" but this call passes only {list(declared or ())}: KeyError at the first step; add"
                    f" {keys} to callback_on_step_end_tensor_inputs",
                )
        yield from self._pipeline_callbacks(module)

    @staticmethod
    def _declared(module: Module, call: ast.Call) -> tuple[str, ...] | None:
        """The tensor names the call declares, or None when that is not certain."""
        given = keyword(call, "callback_on_step_end_tensor_inputs")
        if given is not None:
            return _literal_names(given.value)
        if any(k.arg is None for k in call.keywords):
            return None  # **kwargs may declare them
        pipeline = module.pipeline_of(call)
        if pipeline is None:
            return None
        facts = pipeline_class(pipeline.name) if pipeline.name else None
        if facts is not None:
            return facts.tensor_inputs_default
        return DEFAULT_TENSOR_INPUTS

    def _no_return(self, module: Module, function: FunctionNode, kwargs_name: str) -> Finding:
        return module.finding(
            self,
            function,
            f"callback {function.name} can end without returning {kwargs_name}: diffusers pops from what the"
            f" callback returns, so that step fails with AttributeError; end every path with"
            f" `return {kwargs_name}`",
        )

    def _pipeline_callbacks(self, module: Module) -> Iterator[Finding]:
        """``class C(PipelineCallback)``: ``callback_fn`` returns on every path and reads its inputs only."""
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [module.value(b) for b in node.bases]
            if not any(b is not None and b.imported("diffusers") == "PipelineCallback" for b in bases):
                continue
            methods = {s.name: s for s in node.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
            callback = methods.get("callback_fn")
            kwargs_name = _kwargs_parameter(callback, 5) if callback is not None else None
            if callback is None or kwargs_name is None:
                continue
            if not returns_value(callback):
                yield self._no_return(module, callback, kwargs_name)
            declared = next(
                (
                    _literal_names(s.value)
                    for s in node.body
                    if isinstance(s, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "tensor_inputs" for t in s.targets)
                ),
                None,
            )
            missing = (
                sorted(set(_read_keys(callback, kwargs_name)) - set(declared or ()))
                if declared is not None
                else []
            )
            if missing:
                yield module.finding(
                    self,
                    callback,
                    f"{node.name}.callback_fn reads callback_kwargs{missing} but tensor_inputs ="
                    f" {list(declared or ())}:"
                    " KeyError at the first step; add them to tensor_inputs",
                )


def _kwargs_parameter(function: FunctionNode, count: int) -> str | None:
    """The name of the ``callback_kwargs`` parameter: the last of exactly ``count`` positional ones."""
    positional = [a.arg for a in function.args.posonlyargs + function.args.args]
    if len(positional) == count + 1 and positional[0] in ("self", "cls"):
        positional = positional[1:]
    if len(positional) != count or function.args.vararg is not None:
        return None
    return positional[-1]


def _literal_names(expr: ast.expr) -> tuple[str, ...] | None:
    if not isinstance(expr, (ast.List, ast.Tuple)):
        return None
    names = [e.value for e in expr.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return tuple(names) if len(names) == len(expr.elts) else None


def _read_keys(function: FunctionNode, name: str) -> dict[str, ast.AST]:
    """Keys read from ``name`` that must be there: ``name["k"]`` (loaded) and ``name.pop("k")``.

    Empty when ``name`` is reassigned or written to (a key the callback sets itself is not a read).
    """
    reads: dict[str, ast.AST] = {}
    for node in walk_function(function):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return {}
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == name:
            if not isinstance(node.ctx, ast.Load):
                return {}
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                reads.setdefault(node.slice.value, node)
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "pop"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == name
            and len(node.args) == 1
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            reads.setdefault(node.args[0].value, node)
    return reads
