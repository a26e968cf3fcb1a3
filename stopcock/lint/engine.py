"""The rule engine: a parsed module with its resolver, the rule base class, findings and fixes.

Every front end (``stopcock check``, the flake8 plugin, ``--fix``) runs the rules through
:mod:`stopcock.lint.checker` (selection and ``noqa``); rules only read the module and return
:class:`Finding` objects.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from .resolve import FunctionNode, Resolver, Value

__all__ = ["Edit", "Fix", "Finding", "Module", "Rule"]

CALLBACK_KEYWORDS = ("callback_on_step_end", "prior_callback_on_step_end")
LOOPS = (ast.For, ast.AsyncFor, ast.While)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


@dataclass(frozen=True)
class Edit:
    """Replace the source text from character offset ``start`` to ``end`` (exclusive) by ``text``."""

    start: int
    end: int
    text: str


@dataclass(frozen=True)
class Fix:
    """A rewrite that removes a finding; ``imports`` are top-level import lines it needs."""

    description: str
    edits: tuple[Edit, ...]
    imports: tuple[str, ...] = ()


@dataclass(frozen=True)
class Finding:
    """One problem. ``line`` is 1-based and ``col`` 0-based, in the text that was checked."""

    code: str
    line: int
    col: int
    message: str
    fix: Fix | None = field(default=None, compare=False)


class Rule:
    """One check. Subclasses set the class attributes (they are the rule's docs) and :meth:`check`."""

    code: ClassVar[str]
    name: ClassVar[str]
    summary: ClassVar[str]
    explanation: ClassVar[str]
    wrong: ClassVar[str]
    right: ClassVar[str]
    upstream: ClassVar[tuple[str, ...]]  # issues that show the bug, "owner/repo#N: what it shows"
    fixable: ClassVar[bool] = False

    def check(self, module: Module) -> Iterator[Finding]:
        raise NotImplementedError

    @classmethod
    def docs(cls) -> str:
        """The rule's documentation as Markdown (``stopcock check --explain CODE``)."""
        issues = "\n".join(f"- {issue}" for issue in cls.upstream)
        fix = "`--fix` rewrites the simple cases." if cls.fixable else "Not fixed automatically."
        return (
            f"## {cls.code} {cls.name}\n\n{cls.summary}\n\n{textwrap.dedent(cls.explanation).strip()}\n\n"
            f"Wrong:\n\n```python\n{textwrap.dedent(cls.wrong).strip()}\n```\n\n"
            f"Right:\n\n```python\n{textwrap.dedent(cls.right).strip()}\n```\n\n"
            f"Upstream:\n\n{issues}\n\n{fix}\n"
        )


class Module:
    """A parsed module and what the rules ask of it."""

    def __init__(self, tree: ast.Module, source: str = "") -> None:
        self.tree = tree
        self.source = source
        self.resolver = Resolver(tree)
        self.calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]

    # values
    def value(self, expr: ast.AST | None) -> Value | None:
        return self.resolver.value(expr)

    def pipeline_of(self, call: ast.Call) -> Value | None:
        """The diffusers pipeline that ``call`` calls, when certain."""
        value = self.value(call.func)
        return value if value is not None and value.kind == "diffusers_pipeline" else None

    def is_run_call(self, call: ast.Call) -> bool:
        """A call that runs a model: a diffusers or transformers pipeline, ``generate``, ``stopcock.run``."""
        value = self.value(call.func)
        if value is not None:
            if value.kind in ("diffusers_pipeline", "transformers_pipeline"):
                return True
            if value.imported("stopcock") in ("run", "arun", "stream", "astream"):
                return True
        func = call.func
        if isinstance(func, ast.Attribute):
            receiver = self.value(func.value)
            if receiver is not None and receiver.kind == "transformers_model" and func.attr == "generate":
                return True
        return False

    def callback_sites(self) -> Iterator[tuple[ast.Call, ast.keyword, FunctionNode]]:
        """``pipe(..., callback_on_step_end=fn)`` with ``fn`` a function defined in this file."""
        for call in self.calls:
            for keyword in call.keywords:
                if keyword.arg in CALLBACK_KEYWORDS:
                    function = self.callback_function(keyword.value)
                    if function is not None:
                        yield call, keyword, function

    def callback_function(self, expr: ast.expr) -> FunctionNode | None:
        """The function ``expr`` names, or that a factory called in ``expr`` returns (``make_callback()``)."""
        function = self.resolver.function(expr)
        if function is not None or not isinstance(expr, ast.Call) or expr.args or expr.keywords:
            return function
        factory = self.resolver.function(expr.func)
        if factory is None:
            return None
        returned = [n.value for n in walk_function(factory) if isinstance(n, ast.Return)]
        inner = {self.resolver.function(r, self.resolver.scopes[factory]) for r in returned if r is not None}
        return inner.pop() if len(inner) == 1 and len(returned) >= 1 else None

    # structure
    def enclosing_loops(self, node: ast.AST) -> list[ast.For | ast.AsyncFor | ast.While]:
        """Loops around ``node`` within its function (innermost first), entered through their body."""
        loops = []
        child = node
        for parent in self.resolver.ancestors(node):
            if isinstance(parent, SCOPES):
                break
            if isinstance(parent, LOOPS) and child not in (
                parent.iter if isinstance(parent, ast.For) else None,
                getattr(parent, "test", None),
            ):
                loops.append(parent)
            child = parent
        return loops

    def finding(
        self, rule: type[Rule] | Rule, node: ast.AST, message: str, fix: Fix | None = None
    ) -> Finding:
        return Finding(rule.code, getattr(node, "lineno", 1), getattr(node, "col_offset", 0), message, fix)

    def text(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.source, node) or ast.unparse(node)


def walk_function(function: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function's body, not entering nested functions, lambdas or classes."""
    stack = list(ast.iter_child_nodes(function))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def keyword(call: ast.Call, name: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == name), None)


def same(a: ast.AST, b: ast.AST) -> bool:
    """The same expression text (``pipe`` and ``pipe``, ``self.pipe`` and ``self.pipe``)."""
    return ast.dump(a) == ast.dump(b)


def returns_value(function: FunctionNode) -> bool:
    """Whether every path through the function ends in ``return <value>`` (not None) or ``raise``."""
    early = any(isinstance(n, ast.Return) and not _ends(n) for n in walk_function(function))
    return not early and always_returns_value(function.body)


def always_returns_value(body: Sequence[ast.stmt]) -> bool:
    """Whether ``body`` never falls off its end: it ends in ``return <value>``, ``raise`` or an exit."""
    for stmt in body:
        if _ends(stmt):
            return True
    return False


def _ends(stmt: ast.stmt) -> bool:
    if isinstance(stmt, ast.Return):
        return stmt.value is not None and not (
            isinstance(stmt.value, ast.Constant) and stmt.value.value is None
        )
    if isinstance(stmt, ast.Raise):
        return True
    if isinstance(stmt, ast.If):
        return always_returns_value(stmt.body) and always_returns_value(stmt.orelse)
    if isinstance(stmt, (ast.With, ast.AsyncWith)):
        return always_returns_value(stmt.body)
    if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
        body: list[ast.stmt] = getattr(stmt, "body", [])
        handlers: list[ast.ExceptHandler] = getattr(stmt, "handlers", [])
        if always_returns_value(getattr(stmt, "finalbody", [])):
            return True
        main = always_returns_value(body) or always_returns_value(getattr(stmt, "orelse", []))
        return main and all(always_returns_value(h.body) for h in handlers)
    if isinstance(stmt, ast.Match):
        exhaustive = any(
            isinstance(c.pattern, ast.MatchAs) and c.pattern.pattern is None and c.guard is None
            for c in stmt.cases
        )
        return exhaustive and all(always_returns_value(c.body) for c in stmt.cases)
    if isinstance(stmt, ast.While):  # `while True:` without break never falls through
        forever = isinstance(stmt.test, ast.Constant) and bool(stmt.test.value)
        return forever and not any(isinstance(n, ast.Break) for n in _loop_own_nodes(stmt))
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        func = stmt.value.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return name in ("exit", "_exit", "abort")  # sys.exit(), os._exit(), pytest's fail-style aborts
    return False


def _loop_own_nodes(loop: ast.AST) -> Iterator[ast.AST]:
    """Nodes of a loop's body that belong to it (not to a nested loop or function)."""
    stack = [n for stmt in getattr(loop, "body", []) for n in [stmt]]
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (*LOOPS, *SCOPES)):
            stack.extend(ast.iter_child_nodes(node))
