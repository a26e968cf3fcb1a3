"""The server's API docs work offline: ``/docs`` and ``/redoc`` load their scripts and styles from the
server itself, and Swagger UI renders the API in a real browser that can reach no other host."""

from __future__ import annotations

import re

import httpx
import pytest
from browser import chromium  # tests/ is on sys.path under pytest

from stopcock.server.app import _operations_page
from stopcock.server.testing import serving

KEY = "docs-key"


@pytest.fixture(scope="module")
def url(server_backends, one_torch_thread):
    with serving(server_backends, api_keys=[KEY], concurrency=1, queue_size=2) as (base, _):
        yield base


def _references(page: str) -> list[str]:
    return re.findall(r"""(?:src|href|url)\s*[=:]\s*["']([^"']+)["']""", page)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_the_api_docs_refer_to_no_other_host_and_their_assets_are_served(url, path):
    page = httpx.get(f"{url}{path}", timeout=30)
    assert page.status_code == 200
    assert "http://" not in page.text and "https://" not in page.text and "//cdn" not in page.text
    refs = _references(page.text)
    assert "/openapi.json" in refs
    assets = [r for r in refs if r.startswith("/docs/assets/")]
    assert len(assets) >= 2, refs  # the script and the icon at least; Swagger UI also its styles
    for asset in assets:
        answer = httpx.get(f"{url}{asset}", timeout=30)
        assert answer.status_code == 200 and len(answer.content) > 0, asset
    assert httpx.get(f"{url}/openapi.json", timeout=30).json()["info"]["title"] == "stopcock"


def test_without_the_bundled_assets_docs_is_a_plain_list_of_operations():
    schema = {"info": {"version": "9.9"}, "paths": {"/v1/jobs": {"post": {"summary": "Start a <job>"}}}}
    page = _operations_page(schema, "/openapi.json")
    assert "<code>POST</code>" in page and "<code>/v1/jobs</code>" in page and "Start a &lt;job&gt;" in page
    assert "http" not in page and "stopcock[server]" in page


@pytest.mark.timeout(180)
def test_swagger_ui_renders_the_api_in_a_browser_that_reaches_no_other_host(url):
    from playwright.sync_api import Route

    elsewhere: list[str] = []

    def only_this_server(route: Route) -> None:
        if route.request.url.startswith(url):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort()

    with chromium() as browser:
        page = browser.new_page()
        page.set_default_timeout(60_000)
        page.route("**/*", only_this_server)
        page.goto(f"{url}/docs")
        page.locator(".opblock-summary-path[data-path='/v1/jobs']").first.wait_for()
        assert page.locator(".opblock").count() >= 10
        assert "stopcock API" in page.title()
    assert elsewhere == []
