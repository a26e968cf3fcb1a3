"""Text edits for ``--fix``: cut arguments out of a call, wrap it, add a comment or an import.

Edits are computed on the source text (ast positions turned into character offsets), so everything
the rewrite does not touch keeps its formatting and comments. ``--diff`` shows the result.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Iterable, Sequence

from .engine import Edit, Finding, Module

__all__ = ["apply_fixes", "call_without", "diff", "statement_of", "todo_comment"]


class _Offsets:
    """(line, UTF-8 byte column) as ast reports them -> character offset in the text."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def __call__(self, line: int, byte_col: int) -> int:
        text = self.lines[line - 1] if line - 1 < len(self.lines) else ""
        return self.starts[line - 1] + len(text.encode("utf-8")[:byte_col].decode("utf-8", "replace"))


def _offsets(module: Module) -> _Offsets:
    cached = getattr(module, "_offsets", None)
    if cached is None:
        cached = _Offsets(module.source)
        module._offsets = cached  # type: ignore[attr-defined]
    return cached


def _span(module: Module, node: ast.AST) -> tuple[int, int]:
    at = _offsets(module)
    return at(node.lineno, node.col_offset), at(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined, arg-type]


def statement_of(module: Module, node: ast.AST) -> ast.stmt | None:
    """The statement that contains ``node``."""
    for parent in [node, *module.resolver.ancestors(node)]:
        if isinstance(parent, ast.stmt):
            return parent
    return None


def call_without(
    module: Module,
    call: ast.Call,
    removed: Sequence[ast.keyword],
    *,
    wrap: str | None = None,
    extra: str | None = None,
    suffix: str = "",
) -> Edit:
    """The call with the ``removed`` keyword arguments cut out (commas and layout kept right).

    ``wrap="stopcock.run"`` turns ``f(a, b)`` into ``stopcock.run(f, a, b)``; ``extra`` is added as the
    last argument and ``suffix`` after the call.
    """
    source = module.source
    start, end = _span(module, call)
    func_end = _span(module, call.func)[1]
    open_paren = source.index("(", func_end)
    close_paren = end - 1
    arguments: list[ast.expr | ast.keyword] = sorted(
        [*call.args, *call.keywords], key=lambda a: (a.lineno, a.col_offset)
    )
    spans = [_span(module, a) for a in arguments]
    drop = [a in removed for a in arguments]
    cuts: list[tuple[int, int]] = []
    i = 0
    while i < len(arguments):
        if not drop[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(arguments) and drop[j + 1]:
            j += 1
        if i > 0:  # from the end of the argument kept before the run to the end of the run
            cuts.append((spans[i - 1][1], spans[j][1]))
        elif j + 1 < len(arguments):  # a leading run: up to the first argument kept after it
            cuts.append((spans[i][0], spans[j + 1][0]))
        else:  # every argument goes, a trailing comma with them
            cuts.append((spans[i][0], close_paren))
        i = j + 1
    inner = source[open_paren + 1 : close_paren]
    for cut_start, cut_end in reversed(cuts):
        inner = inner[: cut_start - open_paren - 1] + inner[cut_end - open_paren - 1 :]
    kept = [a for a, d in zip(arguments, drop, strict=True) if not d]
    if extra is not None:
        if kept:
            last_end = max(spans[k][1] for k, d in enumerate(drop) if not d)
            position = last_end - open_paren - 1 - sum(e - s for s, e in cuts if e <= last_end)
            inner = f"{inner[:position]}, {extra}{inner[position:]}"
        else:
            inner = extra
    func = source[start:func_end]
    if wrap is not None:
        separator = "" if not inner.strip() else "," if inner[:1].isspace() else ", "
        text = f"{wrap}({func}{separator}{inner})"
    else:
        text = f"{func}{source[func_end:open_paren]}({inner})"
    return Edit(start, end, text + suffix)


def todo_comment(module: Module, statement: ast.stmt, text: str) -> Edit:
    """A ``# TODO(stopcock): text`` line above ``statement``, at its indentation."""
    at = _offsets(module)
    line_start = at(statement.lineno, 0)
    indent = module.source[line_start : at(statement.lineno, statement.col_offset)]
    if indent.strip():  # the statement follows other code on its line (`if x: pipe(...)`)
        indent = ""
    return Edit(line_start, line_start, f"{indent}# TODO(stopcock): {text}\n")


def _add_imports(source: str, imports: Iterable[str]) -> str:
    """``import stopcock`` (and the like) after the module's docstring, ``__future__`` and imports."""
    missing = [line for line in dict.fromkeys(imports) if line not in source.splitlines()]
    if not missing:
        return source
    tree = ast.parse(source)
    after = 0
    for stmt in tree.body:
        is_doc = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and stmt is tree.body[0]
        if is_doc or isinstance(stmt, (ast.Import, ast.ImportFrom)):
            after = stmt.end_lineno or after
        else:
            break
    lines = source.splitlines(keepends=True)
    if after and not lines[after - 1].endswith("\n"):
        lines[after - 1] += "\n"
    block = "".join(f"{line}\n" for line in missing)
    return "".join(lines[:after]) + block + "".join(lines[after:])


def apply_fixes(source: str, findings: Iterable[Finding]) -> tuple[str, int]:
    """The source with every non-overlapping fix applied, and how many were applied."""
    chosen: list[tuple[Edit, ...]] = []
    taken: list[tuple[int, int]] = []
    imports: list[str] = []
    for finding in findings:
        fix = finding.fix
        if fix is None:
            continue
        ranges = [(e.start, e.end) for e in fix.edits]
        if any((s < te and ts < e) or (s == e == ts) for s, e in ranges for ts, te in taken):
            continue  # overlaps a fix already chosen: the next run of --fix gets it
        chosen.append(fix.edits)
        taken.extend(ranges)
        imports.extend(fix.imports)
    edits = sorted((e for group in chosen for e in group), key=lambda e: (e.start, e.end), reverse=True)
    text = source
    for edit in edits:
        text = text[: edit.start] + edit.text + text[edit.end :]
    return _add_imports(text, imports) if chosen else text, len(chosen)


def diff(path: str, before: str, after: str) -> str:
    name = path.lstrip("/")
    return "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{name}", f"b/{name}"
        )
    )
