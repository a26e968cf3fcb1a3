"""MkDocs hook: pages generated from the code at build time, so they cannot drift from it.

- ``<!-- generated: cli -->`` becomes the ``--help`` of ``stopcock`` and of each of its commands,
  from the argparse parser the command itself uses.
- ``<!-- generated: rule STC001 -->`` becomes that rule's own documentation (what ``stopcock check
  --explain STC001`` prints: what it finds and why, whether ``--fix`` fixes it, the upstream reports).
- ``<!-- generated: api run stream ... -->`` becomes a mkdocstrings block (``::: module.name``) for
  each public name of ``stopcock``, at the module that defines it (the package's lazy names included),
  so the reference follows the code wherever a name's implementation lives.
- ``<!-- generated: openapi -->`` becomes the HTTP API, rendered from the OpenAPI schema of the
  server's FastAPI app (built offline over the shipped demo text model; nothing is served).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import textwrap
from typing import Any

CLI_MARK = "<!-- generated: cli -->"
OPENAPI_MARK = "<!-- generated: openapi -->"
HELP_WIDTH = "100"
# Sphinx roles in docstrings (":class:`~stopcock.StopSignal`"), as Markdown renders them: shown as code.
SPHINX_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):<code>~?([^<]*)</code>")
API_MARK = re.compile(r"<!-- generated: api ([\w ]+) -->")
RULE_MARK = re.compile(r"<!-- generated: rule (STC\d{3}) -->")


def cli_reference() -> str:
    """The help of the ``stopcock`` command and of every subcommand, as Markdown."""
    from stopcock.cli import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH  # argparse wraps at $COLUMNS: a fixed width, the same page anywhere
    try:
        parser = build_parser()
        parts = ["### `stopcock`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    parts += [f"### `stopcock {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(parts)


def openapi_schema() -> dict[str, Any]:
    """The server's OpenAPI schema, from the app over the demo text model (the schema does not depend on
    which models are served)."""
    from stopcock.server import LocalEngine, TextBackend, create_app
    from stopcock.tiny.demo import demo_model

    engine = LocalEngine({"text": TextBackend.load(str(demo_model("text")))})
    try:
        return create_app(engine).openapi()
    finally:
        engine.close()


def _type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#{name.lower()})"
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_type(s) for s in schema[key])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"array of {_type(schema.get('items', {}))}"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    return f"`{kind}`"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def http_reference(schema: dict[str, Any]) -> str:
    """The schema as Markdown: every operation (parameters, body, responses), then every model."""
    out: list[str] = ["## Operations", ""]
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            out += [f"### `{method.upper()} {path}`", ""]
            if op.get("summary"):
                out += [f"**{_cell(op['summary'])}**", ""]
            if op.get("description"):
                out += [op["description"].strip(), ""]
            params = op.get("parameters", [])
            if params:
                out += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
                for p in params:
                    required = "yes" if p.get("required") else "no"
                    out.append(f"| `{p['name']}` | {p['in']} | {_type(p.get('schema', {}))} |"
                               f" {required} | {_cell(p.get('description', ''))} |")
                out.append("")
            body = op.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                out += [f"Request body ({media}): {_type(content.get('schema', {}))}", ""]
            out += ["| response | description |", "|---|---|"]
            for code, response in op.get("responses", {}).items():
                types = [_type(c.get("schema", {})) for c in response.get("content", {}).values()]
                kinds = f" ({', '.join(types)})" if types and types != ["`any`"] else ""
                out.append(f"| {code} | {_cell(response.get('description', ''))}{kinds} |")
            out.append("")
    out += ["## Models", ""]
    for name, model in schema.get("components", {}).get("schemas", {}).items():
        out += [f"### {name}", ""]
        if model.get("description"):
            out += [model["description"].strip(), ""]
        props = model.get("properties", {})
        if props:
            needed = set(model.get("required", []))
            out += ["| field | type | required | description |", "|---|---|---|---|"]
            for field, prop in props.items():
                out.append(f"| `{field}` | {_type(prop)} | {'yes' if field in needed else 'no'} |"
                           f" {_cell(prop.get('description', ''))} |")
            out.append("")
        elif "enum" in model:
            out += [f"One of {_type(model)}.", ""]
    out += ['??? note "The whole schema (openapi.json)"', "", "    ```json"]
    out += ["    " + line for line in json.dumps(schema, indent=2).splitlines()]
    out += ["    ```", ""]
    return "\n".join(out)


def rule_reference(code: str) -> str:
    """A linter rule's documentation, from the rule class itself."""
    from stopcock.lint.rules import rule

    found = rule(code)
    if found is None:
        raise ValueError(f"docs: no linter rule {code}")
    parts = [f"`{found.code}` `{found.name}`: {found.summary}.", "",
             "## What it finds, and why it is wrong", "", textwrap.dedent(found.explanation).strip(), "",
             "## Fix", ""]
    if found.fixable:
        parts.append("`stopcock check --fix` rewrites it (`--diff` shows the change first).")
    else:
        parts.append("Not fixed automatically: change the code as in the example below.")
    parts += ["", "## Reported upstream", ""]
    parts += [f"- {line}" for line in found.upstream]
    return "\n".join(parts) + "\n"


def api_blocks(names: str) -> str:
    """``::: module.qualname`` for each public name of ``stopcock``, where it is defined."""
    import stopcock

    blocks = []
    for name in names.split():
        if name not in stopcock.__all__:
            raise ValueError(f"docs: {name!r} is not a public name of stopcock")
        obj = getattr(stopcock, name)
        where = getattr(obj, "__qualname__", None)
        # a type alias (Event) has no qualified name: griffe finds it through the package's import
        blocks.append(f"::: {obj.__module__}.{where}" if where else f"::: stopcock.{name}")
    return "\n\n".join(blocks)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    markdown = API_MARK.sub(lambda m: api_blocks(m[1]), markdown)
    markdown = RULE_MARK.sub(lambda m: rule_reference(m[1]), markdown)
    if OPENAPI_MARK in markdown:
        markdown = markdown.replace(OPENAPI_MARK, http_reference(openapi_schema()))
    return markdown


def _role(match: re.Match[str]) -> str:
    name = match[1].rsplit(".", 1)[-1] if "~" in match[0] else match[1]  # "~a.b.C" shows "C", as Sphinx
    return f"<code>{name}</code>"


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return SPHINX_ROLE.sub(_role, html)
