"""``examples/gradio_app.py`` in a real Gradio server and headless Chromium: Draw (or Write), Stop,
and the partial result stays on the page, equal to the same run stopped at that step; no worker
thread is left; a second run works. Skip and Stop after this, over several digits.

A step of each model is held (:mod:`tiny.slow`) until the test has clicked Stop and the page says
the click arrived, so the step the run stops at is known; nothing waits on time.
"""

from __future__ import annotations

import importlib.util
import io
import os
import threading
from pathlib import Path

import httpx
import pytest
from browser import chromium  # tests/ is on sys.path under pytest

import stopcock
from stopcock.gradio import Session, View, enlarge
from tiny.slow import SlowLayer, slow_down

os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
gr = pytest.importorskip("gradio")

ROOT = Path(__file__).resolve().parent.parent
WAIT = 120
HOLD = 5  # the 0-based model call held: the run has done 5 steps, and stops after the 6th


def _example():
    spec = importlib.util.spec_from_file_location("gradio_app", ROOT / "examples" / "gradio_app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@pytest.fixture(scope="module")
def lookups():
    """Every host name this process resolves while the module runs (Gradio must reach no network)."""
    import socket

    seen: list[str] = []
    resolve = socket.getaddrinfo

    def recording(host, *args, **kwargs):
        seen.append(host.decode() if isinstance(host, bytes) else str(host))
        return resolve(host, *args, **kwargs)

    socket.getaddrinfo = recording
    try:
        yield seen
    finally:
        socket.getaddrinfo = resolve


@pytest.fixture(scope="module")
def app(one_torch_thread, lookups):
    """The example over its demo models (loaded here, so a step of each can be held), served on loopback."""
    example = _example()
    image_pipe, text_pipe = example.demo_models()
    holds = {
        "image": slow_down(image_pipe.unet, "conv_in", SlowLayer(hold_at=HOLD)),
        "text": slow_down(text_pipe.model, "transformer.h.0.mlp", SlowLayer(hold_at=HOLD)),
    }
    demo = example.build(image_pipe, text_pipe)
    _, url, _ = demo.launch(
        server_name="127.0.0.1", server_port=_free_port(), prevent_thread_lock=True, quiet=True,
        ssr_mode=False, share=False, theme=example.THEME,
    )
    try:
        yield url, image_pipe, text_pipe, holds
    finally:
        for layer in holds.values():
            layer.release.set()  # a failed test never leaves a step held
        demo.close()


@pytest.fixture(scope="module")
def page(app):
    with chromium() as browser:
        page = browser.new_page()
        outside: list[str] = []  # what the page asks of any host but the app's: nothing, offline
        page.on("request", lambda r: None if r.url.startswith(app[0]) else outside.append(r.url))
        page.set_default_timeout(WAIT * 1000)
        page.goto(app[0])
        yield page
    assert not [u for u in outside if not u.startswith(("data:", "blob:"))], outside


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _status(page, text: str) -> str:
    """Wait until the status line contains ``text``; returns the whole line."""
    page.wait_for_function(
        "t => (document.querySelector('#status')?.innerText || '').includes(t)", arg=text
    )
    return page.inner_text("#status")


def _no_worker_left() -> None:
    workers = [t for t in threading.enumerate() if t.name.startswith("stopcock-worker")]
    for thread in workers:
        thread.join(WAIT)
    assert not [t for t in workers if t.is_alive()]


def _shown_image(page, url: str, selector: str):
    from PIL import Image

    src = page.get_attribute(selector, "src")
    assert src, f"no image in {selector}"
    answer = httpx.get(src if src.startswith("http") else url + src, timeout=WAIT)
    return Image.open(io.BytesIO(answer.content))


@pytest.mark.timeout(WAIT * 4)
def test_stop_keeps_the_partial_image_and_a_second_draw_works(app, page):
    url, image_pipe, _, holds = app
    page.get_by_role("tab", name="Image").click()
    page.fill("#digits textarea, #digits input", "3 1 4")
    page.click("#draw")
    assert holds["image"].entered.wait(WAIT)  # the 6th step of the digit 3 is held
    _status(page, f"Item 1 of 3: step {HOLD}/200")
    page.click("#stop")
    page.wait_for_function("(document.querySelector('#notice')?.innerText || '').includes('Stopping')")
    holds["image"].release.set()

    status = _status(page, "2 not started")  # the last view: the run and its item loop have ended
    assert f"Item 1 of 3: Stopped (user) after {HOLD + 1} of 200 steps: the partial result is kept." in status
    assert "2 not started" in status
    _no_worker_left()
    shown = _shown_image(page, url, "#image img")
    expected = stopcock.run(
        image_pipe, "3", num_inference_steps=200, generator=__import__("torch").Generator().manual_seed(0),
        partial="denoised", stop=stopcock.max_steps(HOLD + 1),
    ).output.images[0]
    assert shown.convert("RGB").tobytes() == enlarge(expected).convert("RGB").tobytes()
    assert page.locator("#gallery img").count() == 1
    page.wait_for_selector("#stop:disabled")  # the buttons are back as they were before the run
    assert page.is_enabled("#draw")

    page.fill("#digits textarea, #digits input", "5")
    page.fill("#steps input[type=number]", "20")
    page.dispatch_event("#steps input[type=number]", "change")
    page.click("#draw")
    assert "Done: 20 of 20 steps" in _status(page, "Done")
    assert page.locator("#gallery img").count() == 1
    _no_worker_left()


@pytest.mark.timeout(WAIT * 4)
def test_stop_keeps_the_partial_text(app, page):
    _, _, text_pipe, holds = app
    page.get_by_role("tab", name="Text").click()
    page.fill("#prompt textarea, #prompt input", "Beautiful is")
    page.click("#write")
    assert holds["text"].entered.wait(WAIT)
    page.wait_for_function("(document.querySelector('#text textarea')?.value || '').length > 0")
    page.click("#stop")
    page.wait_for_function("(document.querySelector('#notice')?.innerText || '').includes('Stopping')")
    holds["text"].release.set()

    assert "Stopped (user) after" in _status(page, "Stopped (user)")
    _no_worker_left()
    shown = page.input_value("#text textarea")
    steps = int(page.inner_text("#status").split("after ")[1].split(" ")[0])
    assert steps == HOLD + 1  # the held step finished, then the stop took effect
    expected = text_pipe("Beautiful is", max_new_tokens=steps, return_full_text=False)[0]["generated_text"]
    assert shown == expected and shown
    page.wait_for_selector("#stop:disabled")
    assert page.is_enabled("#write")


# -- the Session under the buttons, without a browser ----------------------------------------------------
def _views(session: Session, pipe, digits: list[str], **options) -> list[View]:
    """Every view of ``session.stream`` over ``digits``; on a thread of its own (the browser tests'
    Playwright holds an event loop in this one)."""
    import asyncio

    views: list[View] = []

    async def collect() -> None:
        async for view in session.stream(pipe, each=digits, num_inference_steps=8, partial="denoised",
                                         **options):
            views.append(view)

    thread = threading.Thread(target=asyncio.run, args=(collect(),))
    thread.start()
    thread.join(WAIT)
    assert views and not thread.is_alive()
    return views


@pytest.mark.timeout(WAIT)
def test_skip_goes_on_with_the_next_item_and_stop_after_this_starts_no_other(image_pipe, one_torch_thread):
    session = Session()
    assert session.stop() == "Nothing is running."
    said: list[str] = []

    def press(button, at: int):
        """An on_step that clicks ``button`` once, at step ``at`` of the first item (in the run's
        thread, before that step's check: the click lands on that very step)."""

        def on_step(state) -> None:
            if state.step == at and not said:
                said.append(button())

        return on_step

    last = _views(session, image_pipe, ["1", "2"], on_step=press(session.skip, 3))[-1]
    assert said == ["Skipping the current item."]
    assert not last.running and not session.running
    assert [(o.reason, o.steps) for o in last.outcomes] == [("skipped", 3), ("completed", 8)]
    assert len(last.images) == 2 and last.images[0].size == (256, 256)

    said.clear()
    last = _views(session, image_pipe, ["1", "2", "3"], on_step=press(session.stop_after_item, 2))[-1]
    assert said == ["Stopping once the current item is done."]
    assert [(o.reason, o.steps) for o in last.outcomes] == [("completed", 8)]
    assert "Stopped after this item: 2 not started." in last.status


def test_a_session_copy_is_a_new_idle_session():
    import copy

    session = Session()
    fresh = copy.deepcopy(session)  # what gr.State does with its initial value, per browser session
    assert fresh.signal is not session.signal and not fresh.running
    session.close()
    assert session.signal.reason == "closed" and not fresh.signal.stopped


@pytest.mark.timeout(WAIT)
def test_the_buttons_reach_every_run_of_the_session(image_pipe, text_pipe, one_torch_thread):
    """Two events of one page streaming at once (an image and a text): Stop stops both, and each
    keeps its partial."""
    import asyncio

    session = Session()
    ends: list[View] = []

    async def one(started: asyncio.Event, both: asyncio.Event, target, *args, **kwargs) -> None:
        async for view in session.stream(target, *args, **kwargs):
            if view.step >= 2 and view.outcome is None and not started.is_set():
                started.set()
                await both.wait()
        ends.append(view)

    async def main() -> None:
        first, second = asyncio.Event(), asyncio.Event()
        both = asyncio.Event()
        # buffer=1: a run whose consumer waits is held in its step, so neither can end on its own
        tasks = [
            asyncio.create_task(one(first, both, image_pipe, "1", num_inference_steps=50, buffer=1)),
            asyncio.create_task(one(second, both, text_pipe, "Beautiful is", max_new_tokens=50,
                                    min_new_tokens=50, buffer=1)),
        ]
        await asyncio.wait_for(asyncio.gather(first.wait(), second.wait()), WAIT)
        assert session.running and session.stop().startswith("Stopping")
        both.set()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT)

    thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    thread.join(WAIT)
    assert [v.outcome.reason for v in ends] == ["user", "user"]
    assert all(v.outcome.steps < 50 for v in ends)
    image, text = sorted(ends, key=lambda v: v.image is None)
    assert image.image is not None and text.text
    assert not session.running and session.stop() == "Nothing is running."


def test_nothing_reached_beyond_loopback(app, page, lookups):
    """Analytics off, no share link, system fonts: the server resolved no host but loopback."""
    assert lookups and set(lookups) <= set(LOOPBACK), lookups
