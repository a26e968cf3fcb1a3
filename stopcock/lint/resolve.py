"""Static resolution: what a name or expression holds, where the source makes it certain.

Flow-insensitive and conservative: a name is resolved only when every assignment to it in its scope
(``None`` aside) gives the same kind of value; anything else is unknown, and the rules stay quiet on
unknown values. Tracked: imports from ``diffusers``, ``transformers``, ``threading`` and ``stopcock``;
pipelines from ``X.from_pretrained``/``from_single_file``/``from_pipe``/``X(...)``, ``AutoPipelineFor...``,
``DiffusionPipeline``; ``transformers.pipeline(...)``; transformers models from ``from_pretrained``,
and wrapped by peft (``get_peft_model(model, ...)``, ``PeftModel.from_pretrained(model, ...)``: their
``generate`` is the model's); streamers and ``MaxTimeCriteria``; ``self.attr`` assigned in the methods
of one class, or in its body; parameter annotations.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from ..pipeline_facts import is_generic_pipeline_name, is_pipeline_class_name

__all__ = ["Value", "Scope", "Scopes", "Resolver"]

ScopeNode = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef

ROOTS = ("diffusers", "transformers", "threading", "stopcock", "peft")
LOADERS = frozenset({"from_pretrained", "from_single_file", "from_pipe"})
# Methods of a pipeline or model that return the object itself.
PIPELINE_SELF = frozenset({"to"})
MODEL_SELF = frozenset({"to", "cuda", "cpu", "half", "float", "bfloat16", "eval", "requires_grad_"})
STREAMERS = frozenset({"TextIteratorStreamer", "AsyncTextIteratorStreamer"})
# peft's wrappers of a transformers model (their first argument), whose generate() is the model's.
PEFT_WRAPPERS = frozenset({
    "get_peft_model", "PeftModel.from_pretrained", "PeftModelForCausalLM.from_pretrained",
    "PeftModelForSeq2SeqLM.from_pretrained",
})
GENERATING_TASKS = frozenset(
    {"text-generation", "image-text-to-text", "text2text-generation", "summarization", "translation"}
)


@dataclass(frozen=True)
class Value:
    """A resolved value. ``kind`` is one of:

    - ``module``: an imported module (``name``: its dotted name);
    - ``imported``: a name from a tracked package (``name``: ``"diffusers.StableDiffusionPipeline"``);
    - ``diffusers_pipeline``: a pipeline object (``name``: its class, None when only run time knows it);
    - ``transformers_model``: a model loaded by transformers (``name``: the class used to load it);
    - ``transformers_pipeline``: ``transformers.pipeline(...)`` (``name``: the task when literal);
    - ``streamer``: a ``TextIteratorStreamer``; ``max_time``: a ``MaxTimeCriteria`` or a list holding one;
    - ``function``: a function defined in the file (``node``).
    """

    kind: str
    name: str | None = None
    node: ast.AST | None = field(default=None, compare=False)

    def imported(self, root: str) -> str | None:
        """The imported name under package ``root`` (``"diffusers"``), or None."""
        if self.kind == "imported" and self.name and self.name.split(".", 1)[0] == root:
            return self.name.rsplit(".", 1)[1]
        return None


# A binding that adds nothing: evaluation reached the name being resolved (``pipe = pipe.to("cuda")``),
# or ``name = None``.
_SELF = object()


@dataclass
class Scope:
    node: ScopeNode
    parent: Scope | None
    bindings: dict[str, list[ast.AST]] = field(default_factory=dict)
    globals: set[str] = field(default_factory=set)
    attrs: dict[str, list[tuple[ast.expr, Scope]]] = field(default_factory=dict)  # classes: self.X = ...

    def bind(self, name: str, source: ast.AST) -> None:
        self.bindings.setdefault(name, []).append(source)


class Scopes:
    """The scopes of one module by Python's rules: what each binds, where a node stands, which
    function a name defines. Knows nothing of values (:class:`Resolver` adds them)."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.scopes: dict[ast.AST, Scope] = {}
        self.module: Scope
        self._build(tree, None)

    # -- scopes ------------------------------------------------------------------------------------
    def _build(self, node: ScopeNode, parent: Scope | None) -> Scope:
        scope = Scope(node, parent)
        self.scopes[node] = scope
        if parent is None:
            self.module = scope
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None:
                    scope.bind(arg.arg, arg)
        body: list[ast.AST] = [node.body] if isinstance(node, ast.Lambda) else list(node.body)
        for stmt in body:
            self._collect(stmt, scope)
        return scope

    def _collect(self, node: ast.AST, scope: Scope) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope.bind(node.name, node)
            for expr in [*node.decorator_list, *getattr(node, "bases", ()), *self._defaults(node)]:
                self._collect(expr, scope)
            self._build(node, scope)
            return
        if isinstance(node, ast.Lambda):
            self._build(node, scope)
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return  # their targets are their own; nothing tracked is bound inside
        if isinstance(node, ast.Global):
            scope.globals.update(node.names)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                if alias.name != "*":
                    self._target_scope(scope, local).bind(local, node)
            return
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind_target(target, node.value, scope)
        elif isinstance(node, ast.AnnAssign):
            self._bind_target(node.target, node.value if node.value is not None else node, scope)
        elif isinstance(node, (ast.AugAssign, ast.For, ast.AsyncFor)):
            self._bind_target(node.target, None, scope)
        elif isinstance(node, ast.NamedExpr):
            self._bind_target(node.target, node.value, scope)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                if item.optional_vars is not None:
                    self._bind_target(item.optional_vars, None, scope)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            scope.bind(node.name, node)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            scope.bind(node.name, node)
        for child in ast.iter_child_nodes(node):
            self._collect(child, scope)

    @staticmethod
    def _defaults(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return [d for d in [*node.args.defaults, *node.args.kw_defaults] if d is not None]
        return []

    def _target_scope(self, scope: Scope, name: str) -> Scope:
        return self.module if name in scope.globals else scope

    def _bind_target(self, target: ast.expr, value: ast.AST | None, scope: Scope) -> None:
        if isinstance(target, ast.Name):
            self._target_scope(scope, target.id).bind(target.id, value if value is not None else target)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._bind_target(element, None, scope)
        elif isinstance(target, ast.Starred):
            self._bind_target(target.value, None, scope)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
            owner = self._method_class(scope)
            if owner is not None and target.value.id == self._self_name(scope):
                expr = value if isinstance(value, ast.expr) else target
                owner.attrs.setdefault(target.attr, []).append((expr, scope))

    # -- scopes of nodes -----------------------------------------------------------------------------
    def scope_of(self, node: ast.AST) -> Scope:
        """The innermost scope whose code contains ``node`` (a def's own name and decorators excluded)."""
        current = self.parents.get(node)
        child = node
        while current is not None:
            if current in self.scopes and not self._outside(current, child):
                return self.scopes[current]
            child, current = current, self.parents.get(current)
        return self.module

    @staticmethod
    def _outside(scope_node: ast.AST, child: ast.AST) -> bool:
        """Decorators, bases and defaults of a def are evaluated in the enclosing scope."""
        if isinstance(scope_node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return (
                child in scope_node.decorator_list
                or child in getattr(scope_node, "bases", ())
                or (
                    isinstance(scope_node, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and child is scope_node.args
                )
            )
        return False

    def _method_class(self, scope: Scope) -> Scope | None:
        if isinstance(scope.node, (ast.FunctionDef, ast.AsyncFunctionDef)) and scope.parent is not None:
            if isinstance(scope.parent.node, ast.ClassDef):
                return scope.parent
        return None

    @staticmethod
    def _self_name(scope: Scope) -> str | None:
        node = scope.node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list):
                return None
            positional = node.args.posonlyargs + node.args.args
            return positional[0].arg if positional else None
        return None

    def enclosing_function(self, node: ast.AST) -> FunctionNode | None:
        current = self.parents.get(node)
        while current is not None:
            if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return current
            current = self.parents.get(current)
        return None

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        current = self.parents.get(node)
        while current is not None:
            yield current
            current = self.parents.get(current)

    def lookup(self, name: str, scope: Scope) -> tuple[list[ast.AST], Scope] | None:
        """The bindings of ``name`` seen from ``scope`` (Python's rules: class bodies are skipped)."""
        current: Scope | None = self.module if name in scope.globals else scope
        first = True
        while current is not None:
            if (first or not isinstance(current.node, ast.ClassDef)) and name in current.bindings:
                return current.bindings[name], current
            first = False
            current = current.parent
        return None

    # -- helpers for rules ---------------------------------------------------------------------------
    def function(self, expr: ast.AST | None, scope: Scope | None = None) -> FunctionNode | None:
        """The function defined in this file that ``expr`` names (a name, ``self.method``), or None."""
        if expr is None:
            return None
        scope = scope or self.scope_of(expr)
        if isinstance(expr, ast.Name):
            found = self.lookup(expr.id, scope)
            if found is not None and len(found[0]) == 1:
                node = found[0][0]
                return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            owner = self._method_class(scope)
            if owner is not None and expr.value.id == self._self_name(scope):
                methods = owner.bindings.get(expr.attr, [])
                if len(methods) == 1 and isinstance(methods[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
                    return methods[0]
        return None


class Resolver(Scopes):
    """:meth:`value` of an expression in its scope, over the module's :class:`Scopes`."""

    # -- values ------------------------------------------------------------------------------------
    def value(self, expr: ast.AST | None, scope: Scope | None = None) -> Value | None:
        """What ``expr`` holds, or None when the source does not make it certain."""
        if expr is None:
            return None
        result = self._value(expr, scope or self.scope_of(expr), frozenset())
        return result if isinstance(result, Value) else None

    def _value(self, expr: ast.AST, scope: Scope, seen: frozenset[object]) -> Value | object | None:
        if isinstance(expr, ast.Name):
            return self._name(expr.id, scope, seen)
        if isinstance(expr, ast.Attribute):
            return self._attribute(expr, scope, seen)
        if isinstance(expr, ast.Call):
            return self._call(expr, scope, seen)
        if isinstance(expr, (ast.List, ast.Tuple)):
            values = [self._value(e, scope, seen) for e in expr.elts]
            return Value("max_time") if any(v == Value("max_time") for v in values) else None
        if isinstance(expr, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return Value("function", expr.name, expr)
        if isinstance(expr, ast.Lambda):
            return Value("function", None, expr)
        if isinstance(expr, (ast.Import, ast.ImportFrom)):
            return None  # reached only through _name, which knows the alias
        if isinstance(expr, ast.arg):
            return self._annotation(expr.annotation, scope, seen) if expr.annotation is not None else None
        if isinstance(expr, ast.AnnAssign):
            return self._annotation(expr.annotation, scope, seen)
        return None

    def _name(self, name: str, scope: Scope, seen: frozenset[object]) -> Value | object | None:
        found = self.lookup(name, scope)
        if found is None:
            return None
        bindings, owner = found
        key = (name, id(owner))
        if key in seen:
            return _SELF
        seen = seen | {key}
        return _combine(self._binding(source, name, seen) for source in bindings)

    def _binding(self, source: ast.AST, name: str, seen: frozenset[object]) -> Value | object | None:
        """What one binding of ``name`` gives (``_SELF`` for one that adds nothing, such as ``= None``)."""
        if isinstance(source, ast.Constant) and source.value is None:
            return _SELF
        if isinstance(source, ast.Name):  # bound by a for loop, a with, an unpacking: unknown
            return None
        if isinstance(source, (ast.Import, ast.ImportFrom)):
            return self._import(source, name)
        return self._value(source, self.scope_of(source), seen)  # where it stands (a ``global`` one too)

    @staticmethod
    def _import(node: ast.Import | ast.ImportFrom, local: str) -> Value | None:
        for alias in node.names:
            if (alias.asname or alias.name.split(".")[0]) != local:
                continue
            if isinstance(node, ast.Import):
                dotted = alias.name if alias.asname else alias.name.split(".")[0]
                return Value("module", dotted) if dotted.split(".")[0] in ROOTS else None
            module = node.module or ""
            root = module.split(".")[0]
            if node.level or root not in ROOTS:
                return None
            return Value("imported", f"{root}.{alias.name}")
        return None

    def _attribute(self, expr: ast.Attribute, scope: Scope, seen: frozenset[object]) -> Value | object | None:
        if isinstance(expr.value, ast.Name) and expr.value.id == self._self_name(scope):
            return self._self_attribute(expr.attr, scope, seen)
        base = self._value(expr.value, scope, seen)
        if not isinstance(base, Value):
            return base if base is _SELF else None
        if base.kind == "module" and base.name:
            if expr.attr in _SUBMODULE_HINTS:
                return Value("module", f"{base.name}.{expr.attr}")
            return Value("imported", f"{base.name.split('.')[0]}.{expr.attr}")
        if base.kind == "transformers_pipeline" and expr.attr == "model":
            return Value("transformers_model")
        return None

    def _self_attribute(self, attr: str, scope: Scope, seen: frozenset[object]) -> Value | object | None:
        owner = self._method_class(scope)
        if owner is None:
            return None
        key = ("self", attr, id(owner))
        if key in seen:
            return _SELF
        seen = seen | {key}
        if attr not in owner.attrs:  # a class attribute, assigned in the class body only
            body = owner.bindings.get(attr, [])
            defined = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
            if not body or any(isinstance(b, defined) for b in body):
                return None
            return _combine(self._binding(source, attr, seen) for source in body)
        return _combine(
            None
            if isinstance(expr, ast.Attribute) and isinstance(expr.ctx, ast.Store)  # unpacked: unknown
            else _SELF
            if isinstance(expr, ast.Constant) and expr.value is None
            else self._value(expr, method_scope, seen)
            for expr, method_scope in owner.attrs[attr]
        )

    def _call(self, expr: ast.Call, scope: Scope, seen: frozenset[object]) -> Value | object | None:
        func = expr.func
        if isinstance(func, ast.Attribute):
            receiver = self._value(func.value, scope, seen)
            if receiver is _SELF:
                return _SELF if func.attr in MODEL_SELF else None
            if isinstance(receiver, Value):
                if receiver.kind == "diffusers_pipeline" and func.attr in PIPELINE_SELF:
                    return receiver
                if receiver.kind == "transformers_model" and func.attr in MODEL_SELF:
                    return receiver
                if f"{(receiver.imported('peft') or '').removeprefix('peft.')}.{func.attr}" in PEFT_WRAPPERS:
                    return self._wrapped(expr, scope, seen)
                if func.attr in LOADERS:
                    return _loaded(receiver, func.attr)
        callee = self._value(func, scope, seen)
        if not isinstance(callee, Value):
            return None
        if (callee.imported("peft") or "").removeprefix("peft.") in PEFT_WRAPPERS:
            return self._wrapped(expr, scope, seen)
        pipeline = _pipeline(callee.imported("diffusers"))
        if pipeline is not None:
            return pipeline
        transformers_name = callee.imported("transformers")
        if transformers_name == "pipeline":
            task = expr.args[0] if expr.args else _keyword(expr, "task")
            literal = task.value if isinstance(task, ast.Constant) and isinstance(task.value, str) else None
            return Value("transformers_pipeline", literal)
        if transformers_name in STREAMERS:
            return Value("streamer", transformers_name)
        if transformers_name == "MaxTimeCriteria":
            return Value("max_time")
        if transformers_name == "StoppingCriteriaList" and expr.args:
            held = self._value(expr.args[0], scope, seen)
            return Value("max_time") if held == Value("max_time") else None
        return None

    def _wrapped(self, call: ast.Call, scope: Scope, seen: frozenset[object]) -> Value | object | None:
        """A peft wrapper of its first argument: a transformers model if that is one (``_SELF`` when it
        is the name being resolved, ``model = get_peft_model(model, config)``)."""
        inner = self._value(call.args[0], scope, seen) if call.args else None
        model = isinstance(inner, Value) and inner.kind == "transformers_model"
        return inner if inner is _SELF or model else None

    def _annotation(self, annotation: ast.expr | None, scope: Scope, seen: frozenset[object]) -> Value | None:
        """A parameter annotated with a pipeline class (``pipe: StableDiffusionPipeline``, ``X | None``)."""
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            try:
                annotation = ast.parse(annotation.value, mode="eval").body
            except SyntaxError:
                return None
        if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
            sides = [annotation.left, annotation.right]
            real = [s for s in sides if not (isinstance(s, ast.Constant) and s.value is None)]
            return self._annotation(real[0], scope, seen) if len(real) == 1 else None
        if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, (ast.Name, ast.Attribute)):
            head = annotation.value.id if isinstance(annotation.value, ast.Name) else annotation.value.attr
            return self._annotation(annotation.slice, scope, seen) if head == "Optional" else None
        value = self._value(annotation, scope, seen)
        if not isinstance(value, Value):
            return None
        return _pipeline(value.imported("diffusers"))


# Attribute names of tracked modules that are submodules (``diffusers.pipelines``), not classes.
_SUBMODULE_HINTS = frozenset(
    {
        "pipelines",
        "generation",
        "models",
        "schedulers",
        "utils",
        "callbacks",
        "stopping_criteria",
        "streamers",
        "stable_diffusion",
        "adapters",
        "loaders",
    }
)


def _pipeline(diffusers_name: str | None) -> Value | None:
    """A pipeline of class ``diffusers_name`` (class unknown for DiffusionPipeline, AutoPipeline...)."""
    if diffusers_name is None or not is_pipeline_class_name(diffusers_name):
        return None
    return Value("diffusers_pipeline", None if is_generic_pipeline_name(diffusers_name) else diffusers_name)


def _loaded(receiver: Value, loader: str) -> Value | None:
    """What ``X.from_pretrained(...)`` (or ``from_single_file``/``from_pipe``) returns."""
    pipeline = _pipeline(receiver.imported("diffusers"))
    if pipeline is not None:
        return pipeline
    name = receiver.imported("transformers")
    if name is not None and loader == "from_pretrained" and name[:1].isupper():
        return Value("transformers_model", name)
    return None


def _combine(results: Iterable[Value | object | None]) -> Value | None:
    """One value from every binding's: None if any is unknown; ``_SELF`` ones add nothing."""
    values: list[Value] = []
    for result in results:
        if result is _SELF:
            continue
        if not isinstance(result, Value):
            return None
        values.append(result)
    return _merge(values)


def _merge(values: list[Value]) -> Value | None:
    """One value for a name assigned several times: the same value, or pipelines of several classes."""
    if not values:
        return None
    if all(v == values[0] for v in values):
        return values[0]
    if all(v.kind == "diffusers_pipeline" for v in values):
        return Value("diffusers_pipeline")
    return None


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)
