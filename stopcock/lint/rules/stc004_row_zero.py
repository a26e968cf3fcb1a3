"""STC004: a custom ``StoppingCriteria`` that decides for the whole batch from row 0."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..engine import Finding, Module, Rule, walk_function
from ..resolve import FunctionNode

# Calls whose result is one bool (or a 0-d tensor) for the whole batch.
SCALAR_CALLS = frozenset({"bool", "any", "all", "equal", "item", "isinstance"})


class RowZeroCriteria(Rule):
    code = "STC004"
    name = "row-zero-stopping-criteria"
    summary = (
        "a custom `StoppingCriteria.__call__` that returns one bool computed from row 0 (`input_ids[0, -1]`)"
    )
    explanation = """
        `StoppingCriteria.__call__(input_ids, scores)` is asked about every row of the batch and should
        return a BoolTensor of shape `(batch,)`. One that looks only at `input_ids[0]` and returns a
        plain bool decides for the whole batch from the first row: in a batch it stops every row when
        row 0 hits the stop word (cutting the others short) or none when another row does (which then
        runs on to `max_new_tokens`). It is right only at batch size 1.

        Fires on subclasses of transformers' `StoppingCriteria` whose `__call__` reads `input_ids[0...]`,
        never looks at the other rows (no `input_ids[:, ...]`, `input_ids.shape`, `len(input_ids)`, loop
        over the rows) and returns only scalar values (bool constants, comparisons, `bool()`/`any()`/
        `all()`/`torch.equal()`).
        """
    wrong = """
        class StopOnToken(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return input_ids[0, -1] == self.stop_id
        """
    right = """
        class StopOnToken(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return input_ids[:, -1] == self.stop_id          # one answer per row

        # or: model.generate(..., eos_token_id=stop_id), stop_strings=[...] with tokenizer=,
        # or stopcock.stop_strings([...]), which stop each row on its own
        """
    upstream = (
        "bigscience-workshop/lm-evaluation-harness#124: `MultiTokenEOSCriteria` read `input_ids[0, ...]`, so"
        " generate stopped whenever the first example of the batch produced the stop token",
        "huggingface/transformers#26959: a stop-token criterion from the forums stops the whole"
        " batch when one"
        " sentence of the batch hits it",
        "h2oai/h2o-llmstudio#14: `StoppingCriteriaSub` triggers on the first item of the batch",
    )

    def check(self, module: Module) -> Iterator[Finding]:
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.ClassDef) or not _is_criteria(module, node):
                continue
            call = next(
                (
                    s
                    for s in node.body
                    if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == "__call__"
                ),
                None,
            )
            if call is None:
                continue
            positional = [a.arg for a in call.args.posonlyargs + call.args.args]
            if len(positional) < 2:
                continue
            ids = positional[1]
            row_zero = _row_zero_read(call, ids)
            if row_zero is not None and not _reads_other_rows(call, ids) and _returns_scalars(call, ids):
                yield module.finding(
                    self,
                    row_zero,
                    f"{node.name}.__call__ decides for the whole batch from row 0"
                    f" ({module.text(row_zero)}) and"
                    " returns one bool: in a batch it stops every row or none; return a BoolTensor with one"
                    f" value per row (e.g. {ids}[:, -1] == stop_id), or use eos_token_id= / stop_strings=",
                )


def _is_criteria(module: Module, node: ast.ClassDef) -> bool:
    for base in node.bases:
        value = module.value(base)
        if value is not None and value.imported("transformers") == "StoppingCriteria":
            return True
    return False


def _subscript_root(node: ast.Subscript) -> tuple[ast.expr, ast.expr]:
    """The innermost subscripted expression and its first index (``ids[0][-1]`` -> ``ids``, ``0``)."""
    while isinstance(node.value, ast.Subscript):
        node = node.value
    first = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) and node.slice.elts else node.slice
    return node.value, first


def _is_name(expr: ast.expr, name: str) -> bool:
    return isinstance(expr, ast.Name) and expr.id == name


def _row_zero_read(function: FunctionNode, ids: str) -> ast.Subscript | None:
    for node in walk_function(function):
        if isinstance(node, ast.Subscript):
            root, first = _subscript_root(node)
            if _is_name(root, ids) and isinstance(first, ast.Constant) and first.value == 0:
                return node
    return None


def _reads_other_rows(function: FunctionNode, ids: str) -> bool:
    """Any use of ``ids`` other than ``ids[0...]``: a slice over rows, its shape, a loop over it, ...

    ``ids.device`` and ``ids.dtype`` say nothing about rows and do not count.
    """
    row_zero_roots = set()
    for node in walk_function(function):
        if isinstance(node, ast.Attribute) and node.attr in ("device", "dtype") and _is_name(node.value, ids):
            row_zero_roots.add(id(node.value))
        if isinstance(node, ast.Subscript):
            root, first = _subscript_root(node)
            if _is_name(root, ids):
                if isinstance(first, ast.Constant) and first.value == 0:
                    row_zero_roots.add(id(root))
                else:
                    return True
    return any(
        isinstance(n, ast.Name) and n.id == ids and id(n) not in row_zero_roots
        for n in walk_function(function)
    )


def _returns_scalars(function: FunctionNode, ids: str) -> bool:
    """Every ``return`` gives one bool for the batch, and there is at least one."""
    returns = [n for n in walk_function(function) if isinstance(n, ast.Return)]
    assigned = _assignments(function)
    return bool(returns) and all(_scalar(r.value, assigned, 0) for r in returns)


def _assignments(function: FunctionNode) -> dict[str, list[ast.expr]]:
    values: dict[str, list[ast.expr]] = {}
    for node in walk_function(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values.setdefault(target.id, []).append(node.value)
                else:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            values.setdefault(name.id, []).append(target)  # unpacked: not a scalar
        elif isinstance(node, (ast.AugAssign, ast.For, ast.AnnAssign)) and isinstance(node.target, ast.Name):
            values.setdefault(node.target.id, []).append(node.target)
    return values


def _scalar(expr: ast.expr | None, assigned: dict[str, list[ast.expr]], depth: int) -> bool:
    if expr is None or depth > 4:
        return False
    if isinstance(expr, ast.Constant):
        return isinstance(expr.value, bool)
    if isinstance(expr, (ast.Compare, ast.BoolOp)) or (
        isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not)
    ):
        return True
    if isinstance(expr, ast.Call):
        func = expr.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return name in SCALAR_CALLS
    if isinstance(expr, ast.Name) and expr.id in assigned:
        return all(_scalar(v, assigned, depth + 1) for v in assigned[expr.id])
    return False
