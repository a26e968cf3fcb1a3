"""Reporters for ``stopcock check``: text (one line per finding), JSON, and SARIF 2.1.0."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from .engine import Finding
from .rules import RULES, rule
from .sources import Source

__all__ = ["Located", "FORMATS", "render"]

FORMATS = ("text", "json", "sarif")
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"


@dataclass(frozen=True)
class Located:
    """A finding with where it is: the file as given and, for notebooks, the cell."""

    finding: Finding
    source: Source
    display: str  # the path as shown and as the SARIF artifact's relative URI

    @property
    def cell(self) -> int | None:
        return self.source.locate(self.finding.line)[0]

    @property
    def line(self) -> int:
        return self.source.locate(self.finding.line)[1]

    @property
    def column(self) -> int:
        """1-based, in characters (ast counts UTF-8 bytes), as editors and SARIF count."""
        lines = self.source.text.splitlines()
        text = lines[self.finding.line - 1] if 0 < self.finding.line <= len(lines) else ""
        return len(text.encode("utf-8")[: self.finding.col].decode("utf-8", "replace")) + 1


def render(kind: str, located: Sequence[Located], errors: Sequence[tuple[str, str]], checked: int) -> str:
    if kind == "json":
        return _json(located, errors, checked)
    if kind == "sarif":
        return _sarif(located, errors)
    return _text(located)


def _text(located: Sequence[Located]) -> str:
    lines = []
    for item in located:
        where = (
            f"{item.display}:cell {item.cell}, line {item.line}"
            if item.cell is not None
            else f"{item.display}:{item.line}"
        )
        lines.append(f"{where}:{item.column}: {item.finding.code} {item.finding.message}")
    return "\n".join(lines) + ("\n" if lines else "")


def _json(located: Sequence[Located], errors: Sequence[tuple[str, str]], checked: int) -> str:
    findings = []
    for item in located:
        found = rule(item.finding.code)
        findings.append(
            {
                "path": item.display,
                "cell": item.cell,
                "line": item.line,
                "column": item.column,
                "code": item.finding.code,
                "name": found.name if found else None,
                "message": item.finding.message,
                "fixable": item.finding.fix is not None,
            }
        )
    errors_out = [{"path": path, "error": error} for path, error in errors]
    return (
        json.dumps(
            {"version": __version__, "checked": checked, "findings": findings, "errors": errors_out}, indent=2
        )
        + "\n"
    )


def _sarif(located: Sequence[Located], errors: Sequence[tuple[str, str]]) -> str:
    rules = [
        {
            "id": r.code,
            "name": r.name,
            "shortDescription": {"text": _plain(r.summary)},
            "fullDescription": {"text": " ".join(r.explanation.split())},
            "help": {"text": r.docs(), "markdown": r.docs()},
            "defaultConfiguration": {"level": "warning"},
        }
        for r in RULES
    ]
    index = {r.code: i for i, r in enumerate(RULES)}
    results = []
    for item in located:
        message = item.finding.message
        if item.cell is not None:
            message = f"cell {item.cell}, line {item.line}: {message}"
        region = {"startLine": item.source.file_line(item.finding.line)}
        if item.cell is None:
            region["startColumn"] = item.column
        results.append(
            {
                "ruleId": item.finding.code,
                "ruleIndex": index[item.finding.code],
                "level": "warning",
                "message": {"text": message},
                "locations": [
                    {
                        "physicalLocation": {
                            "artifactLocation": {
                                "uri": Path(item.display).as_posix(),
                                "uriBaseId": "%SRCROOT%",
                            },
                            "region": region,
                        },
                    }
                ],
            }
        )
    notifications = [{"level": "error", "message": {"text": f"{path}: {error}"}} for path, error in errors]
    run: dict[str, object] = {
        "tool": {"driver": {"name": "stopcock", "version": __version__, "rules": rules}},
        "columnKind": "unicodeCodePoints",
        "results": results,
    }
    if notifications:
        run["invocations"] = [{"executionSuccessful": False, "toolExecutionNotifications": notifications}]
    return json.dumps({"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}, indent=2) + "\n"


def _plain(markdown: str) -> str:
    return markdown.replace("`", "")
