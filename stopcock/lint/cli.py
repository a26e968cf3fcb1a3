"""``stopcock check PATH...``: the linter's command line.

``add_parser(subparsers)`` registers ``check`` in the ``stopcock`` command; ``main(argv)`` runs it on
its own (``python -m stopcock.lint``). Exit codes: 0 nothing found, 1 findings (or files that could
not be read or parsed), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .checker import check_source
from .engine import Finding
from .report import FORMATS, Located, render
from .rewrite import apply_fixes, diff
from .rules import RULES, rule
from .sources import NotReadable, Source, discover, read

__all__ = ["add_parser", "configure", "main", "run_check"]

EXIT_CLEAN, EXIT_FOUND, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad argument the parser cannot judge (an unknown rule code, a missing path)."""


def _codes(text: str) -> list[str]:
    codes = [c.strip().upper() for c in text.split(",") if c.strip()]
    for code in codes:
        if not any(r.code.startswith(code) for r in RULES):
            known = ", ".join(r.code for r in RULES)
            raise argparse.ArgumentTypeError(f"no rule matches {code!r} (rules: {known})")
    return codes


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "paths",
        nargs="*",
        type=Path,
        metavar="PATH",
        help="files, folders (searched for *.py and *.ipynb) or notebooks; default: .",
    )
    parser.add_argument("--format", choices=FORMATS, default="text", help="default: text")
    parser.add_argument(
        "--select", type=_codes, metavar="CODES", help="only these rules (STC001,STC002, or a prefix: STC00)"
    )
    parser.add_argument("--ignore", type=_codes, metavar="CODES", help="not these rules")
    parser.add_argument("--fix", action="store_true", help="rewrite the simple cases in place (STC001)")
    parser.add_argument(
        "--diff", action="store_true", help="print the fixes as a unified diff; change no file"
    )
    parser.add_argument("--explain", metavar="CODE", help="print a rule's documentation and exit")
    parser.add_argument("--list-rules", action="store_true", help="print the rules and exit")
    parser.set_defaults(func=run_check)
    return parser


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``check`` in the ``stopcock`` command line."""
    return configure(
        subparsers.add_parser(
            "check",
            help="find stop code that silently does nothing (diffusers, transformers)",
            description="Find stop code that silently does nothing, before it runs. Exit codes: 0 nothing"
            " found, 1 findings (or unreadable files), 2 bad arguments.",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )


def run_check(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except UsageError as exc:
        print(f"stopcock check: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace) -> int:
    if args.explain:
        found = rule(args.explain)
        if found is None:
            raise UsageError(f"no rule {args.explain!r}; see stopcock check --list-rules")
        print(found.docs(), end="")
        return EXIT_CLEAN
    if args.list_rules:
        for r in RULES:
            print(f"{r.code}  {r.name:<28} {r.summary.replace('`', '')}")
        return EXIT_CLEAN
    paths = args.paths or [Path(".")]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise UsageError(f"no such file or folder: {', '.join(missing)}")
    located: list[Located] = []
    errors: list[tuple[str, str]] = []
    checked = 0
    for path in discover(paths):
        checked += 1
        try:
            source = read(path)
            findings = check_source(source.text, select=args.select, ignore=args.ignore)
        except NotReadable as exc:
            errors.append((str(path), str(exc)))
            continue
        except SyntaxError as exc:
            errors.append((str(path), f"cannot parse: {exc.msg} (line {exc.lineno})"))
            continue
        except RecursionError:
            errors.append((str(path), "too deeply nested to analyse"))
            continue
        if (args.fix or args.diff) and findings and not source.is_notebook:
            findings = _fix(source, findings, args, errors)
        located.extend(Located(f, source, str(path)) for f in findings)
    if not args.diff:  # --diff prints only the diffs
        sys.stdout.write(render(args.format, located, errors, checked))
    for failed, error in errors:
        print(f"stopcock check: {failed}: {error}", file=sys.stderr)
    if args.format == "text":
        print(_summary(located, checked, args.fix or args.diff), file=sys.stderr)
    return EXIT_FOUND if located or errors else EXIT_CLEAN


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _summary(located: list[Located], checked: int, fixing: bool) -> str:
    if not located:
        return f"no findings in {_plural(checked, 'file')}"
    fixable = sum(1 for item in located if item.finding.fix is not None)
    hint = f" ({fixable} fixable with --fix)" if fixable and not fixing else ""
    return f"{_plural(len(located), 'finding')} in {_plural(checked, 'file')}{hint}"


def _fix(
    source: Source, findings: list[Finding], args: argparse.Namespace, errors: list[tuple[str, str]]
) -> list[Finding]:
    """Apply the fixes (or print them with ``--diff``); the findings left afterwards."""
    fixed, count = apply_fixes(source.text, findings)
    if count == 0:
        return findings
    if args.diff:
        sys.stdout.write(diff(str(source.path), source.text, fixed))
        return findings
    try:
        source.path.write_text(fixed, "utf-8")
    except OSError as exc:
        errors.append((str(source.path), f"cannot write the fix: {exc.strerror or exc}"))
        return findings
    source.text = fixed
    return check_source(fixed, select=args.select, ignore=args.ignore)


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure(
        argparse.ArgumentParser(
            prog="stopcock check", description="Find stop code that silently does nothing, before it runs."
        )
    )
    return run_check(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
