"""Headless Chromium for the browser tests: Debian's package, driven by Playwright (whose own browser
download does not work offline). Missing, it skips a test, and fails it under CI, which must run it."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# No background connections: this machine's network is closed, and a test page must reach only its server.
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update"]


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A launched browser (Playwright's ``Browser``), closed after the block."""
    if not Path(CHROMIUM).exists():
        message = "needs Debian's chromium at /usr/bin/chromium: run `make browser` (as root)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser test: {message}")
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()
