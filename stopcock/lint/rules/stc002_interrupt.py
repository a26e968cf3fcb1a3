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

OUTSIDE_FIX = (
    "keep a stopcock.StopSignal, call signal.stop() from the handler or thread, and run the pipeline"
    " with stopcock.run(pipe, ..., stop=signal) or inside `with stopcock.attach(pipe, signal):`, which"
    " hold the stop until a run ends and stop any pipeline"
)


class InterruptIgnored(Rule):
    code = "STC002"
    name = "interrupt-ignored"
    summary = (
        "`_interrupt` set on a pipeline that never reads it, before the call that resets it, or outside"
        " a step callback"
    )
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

        Set outside a step callback (a Stop button's handler, a watcher thread, a signal handler, module
        code between two calls), the flag races the call: pressed before the call starts or between two
        calls, the reset at the start of the next call erases it; pressed during a call, only the
        pipelines that check the flag read it. Fires on such an assignment to a pipeline object (a
        known class that honours the flag, or one known only at run time), in a function that is not
        given as a callback (to a keyword whose name holds "callback", directly or through
        `functools.partial`) and does not take a step callback's four arguments. The fix is a
        `StopSignal` that the handler stops and the run is given: `stopcock.run(pipe, ..., stop=signal)`
        or `with stopcock.attach(pipe, signal):` keep the stop until a run ends, whichever pipeline it is.

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
            for obj in _flag_set_on(node):
                finding = self._judge(module, node, obj, callbacks)
                if finding is not None:
                    yield finding

    def _judge(
        self, module: Module, node: ast.AST, obj: ast.expr, callbacks: dict[FunctionNode, list[ast.Call]]
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
        if later is not None:
            return module.finding(
                self,
                node,
                f"this `_interrupt = True` is lost: {module.text(obj)}(...) on line {later.lineno}"
                f" starts by setting"
                f" `_interrupt = False`; {FIX}",
            )
        if function is not None and (
            function in callbacks or _looks_like_callback(function) or _given_as_callback(module, function)
        ):
            return None  # inside a step callback: read by the loop that called it
        scope = next((a for a in module.resolver.ancestors(node) if isinstance(a, SCOPES)), None)
        where = (
            "in a lambda"
            if isinstance(scope, ast.Lambda)
            else f"in {function.name}()"
            if function is not None
            else "at module level"
        )
        return module.finding(
            self,
            node,
            f"`{module.text(obj)}._interrupt = True` set outside a step callback ({where}): every call of"
            " the pipeline starts by setting `_interrupt = False`, so a stop that lands before the call"
            " or between two calls is lost, and one during a call is read only by the pipelines whose"
            f" loop checks the flag; {OUTSIDE_FIX}",
        )


def _looks_like_callback(function: FunctionNode) -> bool:
    """A function with a step callback's arguments (pipeline, step, timestep, callback_kwargs; after
    ``self`` for a method), given to a pipeline somewhere this file does not show."""
    positional = [a.arg for a in function.args.posonlyargs + function.args.args]
    if positional and positional[0] in ("self", "cls"):
        positional = positional[1:]
    return len(positional) == 4 or (len(positional) == 3 and function.args.kwarg is not None)


def _given_as_callback(module: Module, function: FunctionNode) -> bool:
    """``function`` is given to some call as a callback (a keyword whose name holds "callback": the
    legacy ``callback=``, a wrapper's own name), directly or through ``functools.partial``."""
    for call in module.calls:
        for given in call.keywords:
            if given.arg is None or "callback" not in given.arg:
                continue
            value = given.value
            if isinstance(value, ast.Call) and value.args and _name_of(value.func).endswith("partial"):
                value = value.args[0]
            if module.resolver.function(value) is function:
                return True
    return False


def _name_of(expr: ast.expr) -> str:
    return expr.attr if isinstance(expr, ast.Attribute) else expr.id if isinstance(expr, ast.Name) else ""


def _flag_set_on(node: ast.AST) -> list[ast.expr]:
    """The objects whose ``_interrupt`` ``node`` sets to a true constant: ``obj._interrupt = True``
    or ``setattr(obj, "_interrupt", True)`` (the form a lambda handler takes)."""
    if isinstance(node, ast.Assign) and _truthy(node.value):
        return [t.value for t in node.targets if isinstance(t, ast.Attribute) and t.attr == "_interrupt"]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and len(node.args) == 3
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "_interrupt"
        and _truthy(node.args[2])
    ):
        return [node.args[0]]
    return []


def _truthy(value: ast.expr) -> bool:
    return isinstance(value, ast.Constant) and bool(value.value) is True


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


def _later_call(module: Module, node: ast.AST, obj: ast.expr) -> ast.Call | None:
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
