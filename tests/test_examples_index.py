"""``examples/README.md`` lists every example, and every file it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def test_the_index_lists_every_example_and_names_only_files_that_exist():
    index = (EXAMPLES / "README.md").read_text("utf-8")
    files = {p.name for p in EXAMPLES.iterdir() if p.is_file() and p.name != "README.md"}
    listed = set(re.findall(r"^\| `([^`]+)` \|", index, re.MULTILINE))
    assert listed == files
    for link in re.findall(r"\]\(([^)]+)\)", index):
        assert (EXAMPLES / link).resolve().is_file(), link
    assert "../deploy/ray-serve.yaml" in index
