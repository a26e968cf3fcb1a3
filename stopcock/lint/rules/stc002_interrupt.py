"""STC002: ``pipe._interrupt = True`` that stops nothing."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ...pipeline_facts import pipeline_class
from ..engine import SCOPES, Finding, Module, Rule, same
from ..resolve import FunctionNode

FIX = (
    "pass the stop into the call: stopcock.run(pipe, ..., stop=signal), `with stopcock.attach(pipe, signal):`"
    " or callback_on_step_end=stopcock.step_callback(signal)"
)


class InterruptIgnored(Rule):
    code = "STC002"
    name = "interrupt-ignored"
    summary = "`_interrupt` set on a pipeline that never reads it, or set before the call that resets it"
    explanation = """
        Diffusers' interrupt is a flag that some denoising loops check at every step
        (`if self.interrupt: continue`). About 40 pipelines never read it (Kandinsky 2.2 and 3, LCM,
        InstructPix2Pix, Stable Video Diffusion, Stable Cascade, AuraFlow, Lumina, the pipelines with a
        legacy `callback`, ...), and 13 read it only in an inner loop while an outer loop keeps working
        (AnimateDiff's free-init, SkyReels-V2, Framepack): setting it does not stop them. Which classes
        honour it is read from the installed diffusers' source, the same analysis stopcock's adapter uses
        at run time (`stopcock.pipeline_facts`); an unknown class is not judged.

        And every pipeline that checks the flag sets `self._interrupt = False` at the start of each call,
        so a flag set before the call (from a Stop button pressed between runs, or just before calling)
        is lost. Fires when the assignment is followed, in the same function, by a call of the same
        pipeline.

        Not fixed automatically: the flag does nothing today, so every rewrite that makes the stop work
        changes what the program does (a run that completes today would stop).
        """
    wrong = """
        pipe = LatentConsistencyModelPipeline.from_pretrained("...")

        def stop_at_ten(pipeline, step, timestep, callback_kwargs):
            if step == 10:
                pipeline._interrupt = True   # LCM never reads it
            return callback_kwargs

        pipe("a cat", callback_on_step_end=stop_at_ten)
        """
    right = """
        pipe = LatentConsistencyModelPipeline.from_pretrained("...")
        outcome = stopcock.run(pipe, "a cat", stop=stopcock.max_steps(10))
        """
    upstream = (
        "huggingface/diffusers#9619: StableDiffusionControlNetPipeline did not support `interrupt`; the flag"
        " was ignored until it was added",
        "huggingface/diffusers#4165: the design of the flag (checked at the top of the denoising loop)",
    )

    def check(self, module: Module) -> Iterator[Finding]:
        callbacks: dict[FunctionNode, list[ast.Call]] = {}
        for call, _keyword, function in module.callback_sites():
            callbacks.setdefault(function, []).append(call)
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Assign) or not _sets_flag(node):
                continue
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "_interrupt":
                    finding = self._judge(module, node, target.value, callbacks)
                    if finding is not None:
                        yield finding

    def _judge(
        self, module: Module, node: ast.Assign, obj: ast.expr, callbacks: dict[FunctionNode, list[ast.Call]]
    ) -> Finding | None:
        value = module.value(obj)
        function = module.resolver.enclosing_function(node)
        if value is not None and value.kind == "diffusers_pipeline" and value.name:
            ignored = _ignores_flag(value.name)
            if ignored is not None:
                return module.finding(self, node, ignored)
        if function is not None and function in callbacks and _is_pipeline_parameter(function, obj):
            for call in callbacks[function]:
                pipeline = module.pipeline_of(call)
                ignored = _ignores_flag(pipeline.name) if pipeline is not None and pipeline.name else None
                if ignored is not None:
                    return module.finding(
                        self, node, f"{ignored} (called with this callback on line {call.lineno})"
                    )
            return None
        if value is None or value.kind != "diffusers_pipeline":
            return None
        facts = pipeline_class(value.name) if value.name else None
        if facts is not None and not facts.resets_interrupt:
            return None
        later = _later_call(module, node, obj)
        if later is None:
            return None
        return module.finding(
            self,
            node,
            f"this `_interrupt = True` is lost: {module.text(obj)}(...) on line {later.lineno}"
            f" starts by setting"
            f" `_interrupt = False`; {FIX}",
        )


def _sets_flag(node: ast.Assign) -> bool:
    return isinstance(node.value, ast.Constant) and bool(node.value.value) is True


def _ignores_flag(class_name: str) -> str | None:
    """The message for a class whose loop never reads the flag, or None (honours it, or unknown)."""
    facts = pipeline_class(class_name)
    if facts is None or facts.honours_interrupt:
        return None
    return (
        f"{class_name} never reads `_interrupt` (its denoising loop has no per-step interrupt check), so this"
        " does not stop it; use stopcock.run(pipe, ..., stop=...) or `with stopcock.attach(pipe, stop):`,"
        " which stop any pipeline"
    )


def _is_pipeline_parameter(function: FunctionNode, obj: ast.expr) -> bool:
    """``obj`` is the callback's pipeline parameter (the first, after ``self`` for a method)."""
    positional = [a.arg for a in function.args.posonlyargs + function.args.args]
    if positional and positional[0] in ("self", "cls") and len(positional) == 5:
        positional = positional[1:]
    return isinstance(obj, ast.Name) and bool(positional) and obj.id == positional[0]


def _later_call(module: Module, node: ast.stmt, obj: ast.expr) -> ast.Call | None:
    """A call of ``obj`` in a statement after ``node``, in its block or an enclosing one of its function."""
    current: ast.AST = node
    for parent in module.resolver.ancestors(node):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and current in block:
                for stmt in block[block.index(current) + 1 :]:
                    call = _call_of(stmt, obj)
                    if call is not None:
                        return call
        if isinstance(parent, SCOPES):
            return None
        current = parent
    return None


def _call_of(stmt: ast.stmt, obj: ast.expr) -> ast.Call | None:
    stack: list[ast.AST] = [stmt]
    while stack:
        item = stack.pop()
        if isinstance(item, ast.Call) and same(item.func, obj):
            return item
        if not isinstance(item, SCOPES):
            stack.extend(ast.iter_child_nodes(item))
    return None
