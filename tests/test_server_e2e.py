"""The web page, end to end in headless Chromium: start a run, click Stop, and check that the page
and the server agree on how it ended. Screenshots are kept in ``artifacts/`` (git-ignored).

The engine's test-only ``step_delay`` throttle keeps the tiny models' jobs running until Stop is
clicked; the test waits for progress on the page (never sleeps) before clicking.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from browser import chromium  # tests/ is on sys.path under pytest

from stopcock.server.testing import serving

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
KEY = "e2e-key"


@pytest.fixture(scope="module")
def url(server_backends, one_torch_thread):
    with serving(server_backends, api_keys=[KEY], concurrency=1, queue_size=4, step_delay=0.02) as (base, _):
        yield base


@pytest.fixture(scope="module")
def page(url):
    with chromium() as browser:
        page = browser.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        page.fill("#key", KEY)
        page.dispatch_event("#key", "change")
        yield page


def _server_view(url: str, job: str) -> dict:
    return httpx.get(f"{url}/v1/jobs/{job}", headers={"Authorization": f"Bearer {KEY}"}).json()


@pytest.mark.parametrize(
    ("kind", "field", "size", "progress"), [("text", "#max-tokens", "1000", 3), ("image", "#steps", "200", 2)]
)
def test_generate_then_stop_in_the_browser(page, url, kind, field, size, progress):
    page.check(f"input[name=kind][value={kind}]")
    page.fill("#prompt", "Once upon a time")
    page.fill(field, size)
    page.click("#generate")
    page.wait_for_function(f"Number(document.getElementById('progress').value) >= {progress}")
    if kind == "text":
        assert page.inner_text("#output").strip()
    else:
        page.wait_for_function("document.getElementById('preview').src.startsWith('data:image/png')")
    page.click("#stop")
    status = page.locator("#status[data-state=stopped]")
    status.wait_for()
    job, step, reason = (status.get_attribute(a) for a in ("data-job", "data-step", "data-reason"))
    text = status.inner_text()
    assert reason == "user" and f"at step {step} of {size}" in text and "Stopped" in text
    assert progress <= int(step) < int(size)
    assert page.is_disabled("#stop") and page.is_enabled("#generate")

    server = _server_view(url, job)
    assert (server["state"], server["reason"], server["step"]) == ("stopped", "user", int(step))
    assert progress <= server["stop_step"] <= int(step) <= server["stop_step"] + 1  # within one step

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / f"server-e2e-{kind}.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 0


def test_skip_and_stop_after_this_one_in_the_browser(page, url):
    """Three prompts, one per line: Skip ends the first, Stop after this one lets the second finish."""
    page.check("input[name=kind][value=text]")
    page.fill("#prompt", "Once upon a time\nHello world\nThe quick brown fox")
    page.check("#each-line")
    page.fill("#max-tokens", "100")
    page.click("#generate")
    items = page.locator("#items li")
    page.wait_for_function("document.querySelector('#items li').dataset.state === 'running'"
                           " && Number(document.getElementById('progress').value) >= 3")
    page.click("#skip")
    items.nth(0).and_(page.locator("[data-reason=skipped]")).wait_for()
    items.nth(1).and_(page.locator("[data-state=running]")).wait_for()
    page.click("#stop-after")
    status = page.locator("#status[data-state=stopped]")
    status.wait_for()
    assert [items.nth(i).get_attribute("data-reason") for i in range(3)] == ["skipped", "completed", None]
    assert items.nth(2).get_attribute("data-state") == "waiting"  # never started
    server = _server_view(url, status.get_attribute("data-job"))
    assert (server["state"], server["reason"]) == ("stopped", "user")
    assert server["outcome"]["item_reasons"] == ["skipped", "completed"]
    assert page.is_disabled("#skip") and page.is_disabled("#stop-after") and page.is_enabled("#generate")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "server-e2e-items.png"), full_page=True)


def test_pause_then_resume_in_the_browser(page, url):
    """Pause keeps the job's checkpoint on the server; Resume finishes it with the image of a run never
    paused (the page's job and a reference job through the API, same parameters and seed)."""
    page.check("input[name=kind][value=image]")
    page.uncheck("#each-line")  # one prompt (the page is shared with the tests before)
    page.fill("#prompt", "Once upon a time")
    page.fill("#steps", "40")
    page.click("#generate")
    page.wait_for_function("Number(document.getElementById('progress').value) >= 2")
    page.click("#pause")
    page.locator("#status[data-state=paused]").wait_for()
    job = page.get_attribute("#status", "data-job")
    server = _server_view(url, job)
    assert server["state"] == "paused" and server["checkpoint_step"] >= 2
    assert page.is_enabled("#resume") and page.is_disabled("#pause")
    assert "Paused at step" in page.inner_text("#status")
    page.click("#resume")
    page.locator("#status[data-state=completed]").wait_for()
    assert page.get_attribute("#status", "data-saved") == str(server["checkpoint_step"])
    assert "resumed, not recomputed" in page.inner_text("#status")
    page.wait_for_function("document.getElementById('preview').src.startsWith('data:image/png')")
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"kind": "image", "prompt": "Once upon a time", "parameters": {"steps": 40}}
    reference = httpx.post(f"{url}/v1/jobs", json=body, headers=headers).json()["id"]
    with httpx.stream("GET", f"{url}/v1/jobs/{reference}/events", headers=headers, timeout=120) as events:
        for _ in events.iter_lines():
            pass
    expected = httpx.get(f"{url}/v1/jobs/{reference}/result", headers=headers).json()["result"]["image"]
    got = httpx.get(f"{url}/v1/jobs/{job}/result", headers=headers).json()["result"]["image"]
    assert got == expected
    assert page.get_attribute("#preview", "src") == "data:image/png;base64," + got
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "server-e2e-pause-resume.png"), full_page=True)
