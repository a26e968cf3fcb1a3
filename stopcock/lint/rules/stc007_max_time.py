"""STC007: one ``MaxTimeCriteria`` reused across generate calls."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..engine import SCOPES, Finding, Module, Rule, keyword, same
from ..resolve import FunctionNode, Scope

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

        Fires when the object is built outside the loop the call is in, stored on `self` (in `__init__`
        or as a class attribute) and used from another method, used by two calls, or built at module
        level and used in a function that runs more than once: one that serves requests (decorated,
        or passed as a callback), a method, a function called from two places or from a loop, or one
        this file never calls (others import it). A list counts when it is built with a
        `MaxTimeCriteria` or one is appended to it (`append`, `extend`, `insert`, `+=`); the criteria
        may be given as `stopping_criteria=` to any call (`generate`, `dict(...)`, `partial(...)`) or as
        the `"stopping_criteria"` key of a dict literal (the generation arguments of a streaming thread).
        A function this file calls once, outside any loop (a script's `main()`), is not judged.
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
        uses: dict[str, list[ast.Call | ast.Dict]] = {}
        for call, given in _sites(module):
            for ref in _references(module, given):
                scope = module.resolver.scope_of(call)
                reason = self._reuse(module, call, ref, scope)
                key = ast.dump(ref) + str(id(_binding_scope(module, ref, scope)))
                uses.setdefault(key, []).append(call)
                if reason is None and len(uses[key]) > 1:
                    reason = f"also used by the call on line {uses[key][0].lineno}"
                if reason is not None:
                    yield module.finding(
                        self,
                        given if isinstance(call, ast.Dict) else _keyword_node(call, given),
                        f"{module.text(ref)} holds a MaxTimeCriteria built once ({reason}): its"
                        f" clock started when"
                        " it was built, so later calls stop at once; build it per call, or pass max_time= /"
                        " stop=stopcock.timeout(...), which count from each call's start",
                    )
                    break

    @staticmethod
    def _reuse(module: Module, call: ast.AST, ref: ast.expr, scope: Scope) -> str | None:
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
        if owner is module.resolver.module and function is not None:
            if any(_inside(module, b, function) for b in bindings):  # rebuilt here (`global criteria`)
                return None
            if _serves_requests(module, function):
                return f"at module level, and {function.name} serves many calls"
            many = _called_often(module, function)
            if many is not None:
                return f"at module level, and {function.name} {many}"
        return None


def _sites(module: Module) -> Iterator[tuple[ast.Call | ast.Dict, ast.expr]]:
    """Each ``stopping_criteria=`` given: a call's keyword (``generate(...)``, ``dict(...)``,
    ``partial(...)``) or a dict literal's key (generation kwargs built for a thread's target)."""
    for call in module.calls:
        given = keyword(call, "stopping_criteria")
        if given is not None:
            yield call, given.value
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "stopping_criteria":
                    yield node, value


def _keyword_node(call: ast.AST, value: ast.expr) -> ast.AST:
    """Where to report: the keyword that gives ``value`` (its position is the keyword's)."""
    if isinstance(call, ast.Call):
        for given in call.keywords:
            if given.value is value:
                return given
    return value


def _called_often(module: Module, function: FunctionNode) -> str | None:
    """How ``function`` is called more than once: a method (called on every object, every time),
    called from two places or from a loop, or never called in this file (others call it); None for
    a function this file calls once, outside any loop (a script's ``main()``)."""
    if isinstance(module.resolver.parents.get(function), ast.ClassDef):
        return "is a method, run at every call"
    calls = [
        call
        for call in module.calls
        if isinstance(call.func, ast.Name)
        and call.func.id == function.name
        and module.resolver.function(call.func) is function
    ]
    if not calls:
        return "is called from outside this file"
    if len(calls) > 1:
        return f"is called on lines {calls[0].lineno} and {calls[1].lineno}"
    loops = module.enclosing_loops(calls[0])
    if loops:
        return f"is called in the loop on line {loops[0].lineno}"
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
    return [c for c in candidates if _holds_max_time(module, c)]


def _holds_max_time(module: Module, ref: ast.expr) -> bool:
    """``ref`` holds a MaxTimeCriteria: built with one, or a list it is appended to
    (``criteria.append(MaxTimeCriteria(30))``, ``extend``, ``insert``, ``+=``) in its scope."""
    value = module.value(ref)
    if value is not None:
        return value.kind == "max_time"
    home = _home(module, ref)
    if home is None:
        return False
    for node in ast.walk(module.tree):
        added: list[ast.expr] = []
        receiver: ast.expr | None = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and same(node.func.value, ref):
            receiver = node.func.value
            if node.func.attr in ("append", "extend"):
                added = node.args[:1]
            elif node.func.attr == "insert":
                added = node.args[1:2]
        elif isinstance(node, ast.AugAssign) and same(node.target, ref):
            receiver, added = node.target, [node.value]
        if added and receiver is not None and _home(module, receiver) is home:
            held = module.value(added[0])
            if held is not None and held.kind == "max_time":
                return True
    return False


def _home(module: Module, ref: ast.expr) -> ast.AST | None:
    """Where ``ref`` lives: the scope that binds a name, the class of ``self.x``."""
    scope = module.resolver.scope_of(ref)
    if isinstance(ref, ast.Name):
        found = module.resolver.lookup(ref.id, scope)
        return found[1].node if found is not None else None
    if isinstance(ref, ast.Attribute) and isinstance(ref.value, ast.Name) and ref.value.id in ("self", "cls"):
        function = module.resolver.enclosing_function(ref)
        parent = module.resolver.parents.get(function) if function is not None else None
        return parent if isinstance(parent, ast.ClassDef) else None
    return None


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
