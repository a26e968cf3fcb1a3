"""What ``stopcock check`` reads: Python files, folders of them, and notebooks' code cells."""

from __future__ import annotations

import ast
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Cell", "Source", "NotReadable", "discover", "read", "notebook_source"]

SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "build", "dist"})


class NotReadable(Exception):
    """A file that cannot be read or parsed: reported, never a traceback."""


@dataclass(frozen=True)
class Cell:
    number: int  # 1-based position among all the notebook's cells
    first_line: int  # the cell's first line in the joined source
    lines: int
    json_lines: tuple[int, ...] | None = None  # the .ipynb line of each source line, when known


@dataclass
class Source:
    """One file as Python text; for a notebook, its code cells joined, magics blanked."""

    path: Path
    text: str
    cells: list[Cell] = field(default_factory=list)

    @property
    def is_notebook(self) -> bool:
        return self.path.suffix == ".ipynb"

    def locate(self, line: int) -> tuple[int | None, int]:
        """(cell number, line in that cell) for a line of :attr:`text`; (None, line) for a .py file."""
        for cell in self.cells:
            if cell.first_line <= line < cell.first_line + cell.lines:
                return cell.number, line - cell.first_line + 1
        return None, line

    def file_line(self, line: int) -> int:
        """The line in the file itself (the .ipynb's JSON line for a notebook, 1 when unknown)."""
        if not self.is_notebook:
            return line
        number, in_cell = self.locate(line)
        cell = next((c for c in self.cells if c.number == number), None)
        if cell is None or cell.json_lines is None or in_cell > len(cell.json_lines):
            return 1
        return cell.json_lines[in_cell - 1]


def discover(paths: Iterable[Path]) -> Iterator[Path]:
    """Files to check: the files named, and ``*.py``/``*.ipynb`` under the folders named (hidden folders,
    virtual environments and build output skipped), each once, in a stable order."""
    seen: set[Path] = set()
    for path in paths:
        if path.is_dir():
            found: list[Path] = []
            for folder, dirs, files in os.walk(path):
                dirs[:] = sorted(
                    d
                    for d in dirs
                    if not d.startswith(".")
                    and d not in SKIPPED_DIRS
                    and not (Path(folder, d) / "pyvenv.cfg").exists()
                )
                found.extend(Path(folder, f) for f in files if f.endswith((".py", ".ipynb")))
            candidates = sorted(found)
        else:
            candidates = [path]
        for candidate in candidates:
            if candidate.resolve() not in seen:
                seen.add(candidate.resolve())
                yield candidate


def read(path: Path) -> Source:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise NotReadable(f"cannot read: {exc.strerror or exc}") from None
    if path.suffix == ".ipynb":
        try:
            notebook = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise NotReadable(f"not a notebook (invalid JSON: {exc})") from None
        return notebook_source(path, notebook, raw.decode("utf-8", "replace"))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise NotReadable("not UTF-8 text") from None
    return Source(path, text)


_MAGIC = re.compile(r"^(\s*)([%!]|\?\w|\w[\w.]*\?\s*$)")


def notebook_source(path: Path, notebook: object, raw: str = "") -> Source:
    """A notebook's code cells as one Python text; IPython magics and shell lines become ``pass``.

    A cell magic (``%%bash``, ``%%time``, ...) makes its whole cell not Python: it is left out. Line
    numbers are kept, so each line maps back to its cell (:meth:`Source.locate`).
    """
    cells = notebook.get("cells") if isinstance(notebook, dict) else None
    if not isinstance(cells, list):
        raise NotReadable("not a notebook (no cells)")
    json_lines = _json_source_lines(raw, len(cells))
    parts: list[str] = []
    located: list[Cell] = []
    line = 1
    for number, cell in enumerate(cells, start=1):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        text = "".join(source) if isinstance(source, list) else str(source)
        lines = text.split("\n")
        if lines and lines[0].lstrip().startswith("%%"):
            lines = ["" for _ in lines]
        else:
            lines = [_unmagic(item) for item in lines]
        body = "\n".join(lines)
        if not _parses(body):  # one broken cell must not hide the others
            lines = ["" for _ in lines]
            body = "\n".join(lines)
        parts.append(body + "\n")
        mapped = json_lines.get(number)
        located.append(
            Cell(number, line, len(lines), mapped if mapped and len(mapped) >= len(lines) - 1 else None)
        )
        line += len(lines)
    return Source(path, "".join(parts), located)


def _unmagic(line: str) -> str:
    match = _MAGIC.match(line)
    return f"{match.group(1)}pass" if match else line


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except SyntaxError:
        return False
    return True


def _json_source_lines(raw: str, count: int) -> dict[int, tuple[int, ...]]:
    """Cell number -> the .ipynb line of each of its source lines, for notebooks written one source line
    per JSON line (as Jupyter writes them); cells laid out otherwise are left out."""
    result: dict[int, tuple[int, ...]] = {}
    cell = 0
    collecting: list[int] | None = None
    for number, text in enumerate(raw.splitlines(), start=1):
        stripped = text.strip()
        if stripped.startswith('"cell_type":'):
            cell += 1
        if collecting is not None:
            if stripped.startswith("]"):
                result[cell] = tuple(collecting)
                collecting = None
            elif stripped.startswith('"'):
                collecting.append(number)
            continue
        if stripped.startswith('"source": [') and 0 < cell <= count:
            if stripped.endswith("[]") or stripped.endswith("],"):
                continue
            collecting = []
    return result
