"""Every Python block of README.md and docs/ runs, so no example can rot.

The convention (docs/index.md says it too):

- The ```` ```python ```` blocks of one page run in order, in one namespace, whose ``__name__`` is not
  ``"__main__"`` (a block ending in ``if __name__ == "__main__": demo.launch()`` defines, but does not
  serve). Blocks in other languages (bash, yaml, json, text) are not run.
- A block whose first line is ``# needs: stopcock serve`` runs against a real ``stopcock serve`` on the
  shipped demo models, on a free loopback port; the block reads its base URL from the environment
  variable ``STOPCOCK_URL``.
- torch runs on one thread, as the demo does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NEEDS_SERVER = "# needs: stopcock serve"
URL_VARIABLE = "STOPCOCK_URL"
SERVER_START_TIMEOUT = 120.0
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the block's first code line
    language: str
    code: str

    @property
    def needs_server(self) -> bool:
        return self.code.lstrip().startswith(NEEDS_SERVER)


def blocks_of(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, in order, dedented (a block may sit in a list)."""
    lines = path.read_text("utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        language = opening["info"].strip().split(" ")[0].lower() if opening["info"].strip() else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if closing and closing["fence"].startswith(fence[0]) and len(closing["fence"]) >= len(fence) \
                    and not closing["info"].strip():
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        else:
            raise AssertionError(f"{path}:{i + 1}: a code block that is never closed")
        found.append(Block(path, i + 2, language, textwrap.dedent("\n".join(body)) + "\n"))
        i = j + 1
    return found


def pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if "_hooks" not in p.parts)
    return [ROOT / "README.md", *docs]


def python_pages() -> list[Path]:
    return [p for p in pages() if any(b.language in ("python", "py") for b in blocks_of(p))]


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def stopcock_serve() -> Iterator[str]:
    """``stopcock serve`` on the demo models on a free loopback port; yields its base URL once it
    listens (it says so on stderr), and stops it with Ctrl+C (SIGINT) at the end."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "stopcock", "serve", "--host", "127.0.0.1", "--port", "0"],
        cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    assert process.stderr is not None
    url: list[str] = []
    said = threading.Event()
    log: list[str] = []

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            log.append(line)
            found = re.search(r"running on (http://\S+)", line)
            if found and not url:
                url.append(found[1])
                said.set()
        said.set()  # the process ended without saying it runs

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        said.wait(SERVER_START_TIMEOUT)
        if not url:
            raise AssertionError("stopcock serve did not start:\n" + "".join(log))
        yield url[0]
    finally:
        import signal

        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(timeout=10)


def run_page(page: Path) -> None:
    python = [b for b in blocks_of(page) if b.language in ("python", "py")]
    namespace: dict[str, object] = {"__name__": f"docs_page_{page.stem.replace('-', '_')}"}
    with contextlib.ExitStack() as stack:
        stack.enter_context(one_torch_thread())
        if any(b.needs_server for b in python):
            url = stack.enter_context(stopcock_serve())
            stack.enter_context(pytest.MonkeyPatch.context()).setenv(URL_VARIABLE, url)
        for block in python:
            # Line numbers in a traceback are the page's own.
            code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
            exec(code, namespace)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", python_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # files a block writes land in a fresh folder
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_page(page)


def test_every_page_is_checked() -> None:
    """The README and the getting-started page have Python blocks, and no Python block hides under
    another language name that this test would not run."""
    checked = {p.relative_to(ROOT).as_posix() for p in python_pages()}
    assert {"README.md", "docs/getting-started.md"} <= checked
    for page in pages():
        for block in blocks_of(page):
            looks_python = block.code.lstrip().startswith(("import ", "from ")) and block.language != "python"
            assert not looks_python, f"{page}:{block.line}: a Python block marked {block.language!r}"


def test_block_parser(tmp_path: Path) -> None:
    """The parser finds indented blocks in lists and longer fences around shorter ones."""
    text = "x\n\n- item\n\n  ```python\n  a = 1\n  ```\n\n````markdown\n```python\nnot_run()\n```\n````\n"
    page = tmp_path / "probe.md"
    page.write_text(text, "utf-8")
    found = blocks_of(page)
    assert [(b.language, b.code) for b in found] == [
        ("python", "a = 1\n"), ("markdown", "```python\nnot_run()\n```\n")]


def test_readme_is_short_and_undated() -> None:
    text = (ROOT / "README.md").read_text("utf-8")
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the limit is 200 (move detail to docs/)"
    dated = re.findall(r"\b20\d\d-\d\d-\d\d\b", text)
    assert not dated, f"README.md holds dates {dated}: measurements belong in bench/RESULTS.md"


def test_blocks_have_no_linter_findings() -> None:
    """``stopcock check`` finds nothing in the examples; on a rule's page, the block marked ``# wrong``
    is found by that rule and the block marked ``# right`` by none."""
    from stopcock.lint.checker import check_source

    for page in pages():
        rule = page.stem if page.parent.name == "linter" and page.stem.startswith("STC") else None
        for block in blocks_of(page):
            if block.language not in ("python", "py"):
                continue
            codes = sorted({f.code for f in check_source(block.code)})
            first = block.code.lstrip().splitlines()[0].lower() if block.code.strip() else ""
            where = f"{page.relative_to(ROOT)}:{block.line}"
            if rule and first.startswith("# wrong"):
                assert rule in codes, f"{where}: the wrong example is not found by {rule}"
            else:
                assert codes == [], f"{where}: stopcock check finds {codes}"


def _hook() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hook", ROOT / "docs" / "_hooks" / "generated.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_page_is_in_the_nav_and_every_rule_has_one() -> None:
    from stopcock.lint.rules import RULES

    nav = (ROOT / "mkdocs.yml").read_text("utf-8")
    for page in pages()[1:]:
        name = page.relative_to(ROOT / "docs").as_posix()
        assert f": {name}" in nav, f"docs/{name} is not in mkdocs.yml's nav"
    for rule in RULES:
        page = ROOT / "docs" / "linter" / f"{rule.code}.md"
        marker = f"<!-- generated: rule {rule.code} -->"
        assert marker in page.read_text("utf-8"), f"{page} lacks its rule's text ({marker})"


def test_generated_pages_cover_the_cli_rules_and_http_api() -> None:
    """What the build hook writes: every command's help, every rule's text, every HTTP operation."""
    from stopcock.cli import build_parser
    from stopcock.lint.rules import RULES

    hook = _hook()
    cli = hook.cli_reference()  # type: ignore[attr-defined]
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in commands.choices:
        assert f"### `stopcock {name}`" in cli
    for rule in RULES:
        assert rule.summary in hook.rule_reference(rule.code)  # type: ignore[attr-defined]
    schema = {"paths": {"/v1/x/{id}": {"post": {"summary": "Do X", "parameters": [
        {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "requestBody": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Job"}}}},
        "responses": {"200": {"description": "OK"}}}}},
        "components": {"schemas": {"Job": {"properties": {"kind": {"enum": ["text", "image"]}},
                                           "required": ["kind"]}}}}
    page = hook.http_reference(schema)  # type: ignore[attr-defined]
    assert "### `POST /v1/x/{id}`" in page and "[`Job`](#job)" in page
    assert '| `kind` | `"text"` \\| `"image"` | yes |' in page


def test_the_api_reference_names_every_public_name() -> None:
    import stopcock

    text = (ROOT / "docs" / "reference" / "api.md").read_text("utf-8")
    listed = {n for line in re.findall(r"<!-- generated: api ([\w ]+) -->", text) for n in line.split()}
    public = set(stopcock.__all__)
    assert listed == public, f"missing {public - listed}, extra {listed - public}"
    blocks = _hook().api_blocks(" ".join(sorted(listed)))  # type: ignore[attr-defined]
    assert blocks.count(":::") == len(listed) and "::: stopcock.runner.run" in blocks


def test_readme_links_resolve() -> None:
    """The README's links into the repository (docs pages, ARCHITECTURE.md) point at files that exist."""
    text = (ROOT / "README.md").read_text("utf-8")
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    assert targets, "the README links into the docs"
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
