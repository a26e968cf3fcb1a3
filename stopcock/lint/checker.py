"""Running the rules over source text: selection (``--select``/``--ignore``) and ``# noqa``.

Apart from :mod:`stopcock.lint.engine` (the rule base and the shared helpers the rules import), so
that the rules never import what runs them.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterable

from .engine import Finding, Module
from .rules import RULES

__all__ = ["check_source", "check_tree", "noqa_lines", "selected"]


# -- running the rules --------------------------------------------------------------------------------
def selected(code: str, select: Iterable[str] | None, ignore: Iterable[str] | None) -> bool:
    """flake8's prefixes: ``STC`` selects every rule, ``STC00`` a group, ``STC001`` one."""
    if select is not None and not any(code.startswith(prefix) for prefix in select):
        return False
    return not (ignore is not None and any(code.startswith(prefix) for prefix in ignore))


def check_tree(
    tree: ast.Module,
    source: str = "",
    *,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
) -> list[Finding]:
    """Every finding of the selected rules in ``tree``, in source order (``noqa`` not applied)."""
    module = Module(tree, source)
    select = list(select) if select is not None else None
    ignore = list(ignore) if ignore is not None else None
    findings = {
        finding for rule in RULES if selected(rule.code, select, ignore) for finding in rule().check(module)
    }
    return sorted(findings, key=lambda f: (f.line, f.col, f.code))


_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:[,\s]+[A-Z]+[0-9]+)*))?", re.IGNORECASE)


def noqa_lines(source: str) -> dict[int, frozenset[str] | None]:
    """Line -> the codes its ``# noqa: ...`` comment names (None: a bare ``# noqa``, every code)."""
    lines: dict[int, frozenset[str] | None] = {}
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT and (match := _NOQA.search(token.string)):
                codes = match.group("codes")
                lines[token.start[0]] = (
                    None if codes is None else frozenset(c.upper() for c in re.split(r"[,\s]+", codes) if c)
                )
    except (tokenize.TokenError, SyntaxError):
        pass
    return lines


def check_source(
    source: str,
    *,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
    noqa: bool = True,
) -> list[Finding]:
    """Check Python source text; raises SyntaxError if it does not parse."""
    findings = check_tree(ast.parse(source), source, select=select, ignore=ignore)
    if not noqa:
        return findings
    waived = noqa_lines(source)
    return [
        f
        for f in findings
        if f.line not in waived or (waived[f.line] is not None and f.code not in waived[f.line])  # type: ignore[operator]
    ]
