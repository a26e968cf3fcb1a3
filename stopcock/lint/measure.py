"""Measure the linter on a labelled corpus kept outside the repository.

``python -m stopcock.lint.measure CORPUS_DIR LABELS.json`` checks every file of the corpus and
compares the findings with hand labels, per rule: true positives, false positives and misses.

``LABELS.json`` maps each file (relative to the corpus) to the misuses it holds, as
``[code, where]`` pairs: ``where`` is the line of a ``.py`` file, or ``"cell N, line M"`` in a
notebook. A file listed with ``[]`` holds none; every file of the corpus must be listed. A finding
counts as a true positive when its code matches a label within two lines (a statement that spans
lines is reported on one of them).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from .checker import check_source
from .rules import RULES
from .sources import NotReadable, discover, read

__all__ = ["main", "measure"]

TOLERANCE = 2  # lines


def _where(cell: int | None, line: int) -> str | int:
    return line if cell is None else f"cell {cell}, line {line}"


def _near(a: str | int, b: str | int) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return abs(a - b) <= TOLERANCE
    if isinstance(a, str) and isinstance(b, str):
        cell_a, line_a = a.split(", line ")
        cell_b, line_b = b.split(", line ")
        return cell_a == cell_b and abs(int(line_a) - int(line_b)) <= TOLERANCE
    return False


def _label_where(where: object) -> str | int:
    if isinstance(where, (int, str)):
        return where
    raise SystemExit(f"a label's place is a line number or 'cell N, line M', got {where!r}")


def measure(corpus: Path, labels: dict[str, list[list[object]]]) -> dict[str, object]:
    """Per-rule counts and the wrong calls, for the files under ``corpus``."""
    counts = {r.code: {"tp": 0, "fp": 0, "fn": 0} for r in RULES}
    wrong: list[str] = []
    files = sorted(discover([corpus]))
    unlabelled = [str(p.relative_to(corpus)) for p in files if str(p.relative_to(corpus)) not in labels]
    if unlabelled:
        raise SystemExit(f"not labelled: {', '.join(unlabelled)}")
    for path in files:
        name = str(path.relative_to(corpus))
        expected: list[tuple[str, str | int]] = [
            (str(code), _label_where(where)) for code, where in labels[name]
        ]
        try:
            source = read(path)
            found: list[tuple[str, str | int]] = [
                (f.code, _where(*source.locate(f.line))) for f in check_source(source.text)
            ]
        except (NotReadable, SyntaxError) as exc:
            found = []
            wrong.append(f"{name}: not checked ({exc})")
        unmatched = list(expected)
        for code, where in found:
            match = next((e for e in unmatched if e[0] == code and _near(e[1], where)), None)
            if match is not None:
                unmatched.remove(match)
                counts[code]["tp"] += 1
            else:
                counts[code]["fp"] += 1
                wrong.append(f"{name}: false positive {code} at {where}")
        for code, where in unmatched:
            counts[code]["fn"] += 1
            wrong.append(f"{name}: missed {code} at {where}")
    return {"files": len(files), "counts": counts, "wrong": wrong}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stopcock.lint.measure", description=__doc__.split("\n")[0]
    )
    parser.add_argument("corpus", type=Path)
    parser.add_argument("labels", type=Path)
    args = parser.parse_args(argv)
    report = measure(args.corpus, json.loads(args.labels.read_text()))
    counts: dict[str, dict[str, int]] = report["counts"]  # type: ignore[assignment]
    print(f"{report['files']} files")
    print("rule     TP  FP  FN")
    for code, c in counts.items():
        print(f"{code}  {c['tp']:>3} {c['fp']:>3} {c['fn']:>3}")
    total = {k: sum(c[k] for c in counts.values()) for k in ("tp", "fp", "fn")}
    print(f"all     {total['tp']:>3} {total['fp']:>3} {total['fn']:>3}")
    for line in report["wrong"]:  # type: ignore[attr-defined]
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
