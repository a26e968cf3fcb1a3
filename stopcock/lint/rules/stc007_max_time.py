"""STC007: one ``MaxTimeCriteria`` reused across generate calls."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..engine import SCOPES, Finding, Module, Rule, keyword
from ..resolve import Scope

# Decorators that say nothing about how often a function is called.
PLAIN_DECORATORS = frozenset(
    {
        "no_grad",
        "inference_mode",
        "staticmethod",
        "classmethod",
        "property",
        "cache",
        "lru_cache",
        "wraps",
        "compile",
        "contextmanager",
        "abstractmethod",
    }
)


class ReusedMaxTime(Rule):
    code = "STC007"
    name = "reused-max-time"
    summary = (
        "one `MaxTimeCriteria` (or a `StoppingCriteriaList` holding one) reused across"
        " calls: its clock started when it was built"
    )
    explanation = """
        `MaxTimeCriteria(max_time)` takes its start time when it is constructed (`initial_timestamp`
        defaults to `time.time()` in `__init__`), not when generation starts. Built once and passed to
        several `generate()` calls (in a loop, from a request handler, as an attribute of a model
        wrapper), every call after the first gets what is left of the first one's budget: they stop
        after one token once the time has passed, and the outputs silently become empty. A fresh one per
        call (or `max_time=` on the call, or `stopcock.timeout()`, which counts from each run's start)
        is right.

        Fires when the object is built outside the loop the call is in, stored on `self` and used from
        another method, used by two calls, or built at module level and used in a function that serves
        requests (decorated, or passed as a callback).
        """
    wrong = """
        criteria = StoppingCriteriaList([MaxTimeCriteria(30)])
        for prompt in prompts:
            out = model.generate(**tokenizer(prompt, return_tensors="pt"), stopping_criteria=criteria)
        """
    right = """
        for prompt in prompts:
            out = model.generate(**tokenizer(prompt, return_tensors="pt"), max_time=30)
        """
    upstream = (
        'no upstream issue found; transformers documents it: `initial_timestamp` "defaults to the time of'
        ' initialization" (`MaxTimeCriteria` in transformers/generation/stopping_criteria.py)',
    )

    def check(self, module: Module) -> Iterator[Finding]:
        uses: dict[str, list[ast.Call]] = {}
        for call in module.calls:
            given = keyword(call, "stopping_criteria")
            if given is None:
                continue
            for ref in _references(module, given.value):
                scope = module.resolver.scope_of(call)
                reason = self._reuse(module, call, ref, scope)
                key = ast.dump(ref) + str(id(_binding_scope(module, ref, scope)))
                uses.setdefault(key, []).append(call)
                if reason is None and len(uses[key]) > 1:
                    reason = f"also used by the call on line {uses[key][0].lineno}"
                if reason is not None:
                    yield module.finding(
                        self,
                        given,
                        f"{module.text(ref)} holds a MaxTimeCriteria built once ({reason}): its"
                        f" clock started when"
                        " it was built, so later calls stop at once; build it per call, or pass max_time= /"
                        " stop=stopcock.timeout(...), which count from each call's start",
                    )
                    break

    @staticmethod
    def _reuse(module: Module, call: ast.Call, ref: ast.expr, scope: Scope) -> str | None:
        if isinstance(ref, ast.Attribute):  # self.criteria: reused unless rebuilt in this method
            method = module.resolver.enclosing_function(call)
            rebuilt = method is not None and any(
                isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Attribute) and t.attr == ref.attr for t in n.targets)
                for n in ast.walk(method)
            )
            return None if rebuilt else "kept on the object and used by every call of this method"
        assert isinstance(ref, ast.Name)
        found = module.resolver.lookup(ref.id, scope)
        if found is None:
            return None
        bindings, owner = found
        loops = module.enclosing_loops(call)
        if loops and not any(_inside(module, b, loops[0]) for b in bindings):
            return f"outside the loop on line {loops[0].lineno}"
        function = module.resolver.enclosing_function(call)
        if owner is module.resolver.module and function is not None and _serves_requests(module, function):
            return f"at module level, and {function.name} serves many calls"
        return None


def _references(module: Module, expr: ast.expr) -> list[ast.expr]:
    """Names or ``self.x`` in ``stopping_criteria=`` that hold a MaxTimeCriteria (or a list with one)."""
    candidates: list[ast.expr] = []
    if isinstance(expr, (ast.Name, ast.Attribute)):
        candidates.append(expr)
    held = expr
    if isinstance(held, ast.Call) and held.args:
        callee = module.value(held.func)
        if callee is not None and callee.imported("transformers") == "StoppingCriteriaList":
            held = held.args[0]
    if isinstance(held, (ast.List, ast.Tuple)):
        candidates.extend(e for e in held.elts if isinstance(e, (ast.Name, ast.Attribute)))
    return [c for c in candidates if (v := module.value(c)) is not None and v.kind == "max_time"]


def _decorator_name(expr: ast.expr) -> str:
    if isinstance(expr, ast.Call):
        expr = expr.func
    return expr.attr if isinstance(expr, ast.Attribute) else expr.id if isinstance(expr, ast.Name) else ""


def _binding_scope(module: Module, ref: ast.expr, scope: Scope) -> Scope | None:
    if isinstance(ref, ast.Name):
        found = module.resolver.lookup(ref.id, scope)
        return found[1] if found is not None else None
    return None


def _inside(module: Module, node: ast.AST, loop: ast.AST) -> bool:
    return any(parent is loop for parent in module.resolver.ancestors(node))


def _serves_requests(module: Module, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated (a route, a tool), or passed somewhere as a value (``gr.Interface(fn=respond)``)."""
    if any(_decorator_name(d) not in PLAIN_DECORATORS for d in function.decorator_list):
        return True
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Name) and node.id == function.name and isinstance(node.ctx, ast.Load):
            parent = module.resolver.parents.get(node)
            if not (isinstance(parent, ast.Call) and parent.func is node) and not isinstance(parent, SCOPES):
                return True
    return False
