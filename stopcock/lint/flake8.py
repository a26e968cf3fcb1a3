"""The flake8 plugin: ``flake8 --select STC`` runs the same rules as ``stopcock check``.

Registered under the ``flake8.extension`` entry point ``STC``. flake8 applies ``# noqa`` and
``--select``/``--ignore`` itself, so the plugin reports every finding.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence

from .. import __version__
from .checker import check_tree

__all__ = ["Plugin"]


class Plugin:
    name = "stopcock"
    version = __version__

    def __init__(self, tree: ast.AST, lines: Sequence[str] = ()) -> None:
        self.tree = tree
        self.source = "".join(lines)

    def run(self) -> Iterator[tuple[int, int, str, type[Plugin]]]:
        if not isinstance(self.tree, ast.Module):
            return
        for finding in check_tree(self.tree, self.source):
            yield finding.line, finding.col, f"{finding.code} {finding.message}", type(self)
