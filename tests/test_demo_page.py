"""The demo as a person sees it: previews decoded from the step's estimate of the clean image (x0), the
web page naming the models it serves with prompts that suit them, and images shown large with crisp
pixels. Real demo models, a real server, real Chromium."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from browser import chromium  # tests/ is on sys.path under pytest

import stopcock
from stopcock.loading import load_image_pipeline, resolve_model
from stopcock.previews import decode_preview, estimate_preview, latent_preview
from stopcock.server.backends import load_backends
from stopcock.server.testing import serving
from stopcock.state import StepState

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def demo_pipe():
    return load_image_pipeline(resolve_model(None, "image"), quiet=True)


def _pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.float64)


@pytest.mark.timeout(120)
def test_the_preview_is_the_decoded_x0_estimate_a_person_recognises(demo_pipe):
    seen: dict[int, StepState] = {}

    def generate(**options):
        generator = torch.Generator().manual_seed(0)
        return stopcock.run(demo_pipe, "7", num_inference_steps=20, generator=generator, **options)

    full = generate()
    stopped = generate(stop=stopcock.max_steps(8), partial="denoised",
                       on_step=lambda s: seen.setdefault(s.step, s))
    state = seen[8]
    x0 = state.extra["denoised"]
    assert x0.shape == state.latents.shape == (1, 4, 8, 8)

    preview = estimate_preview(demo_pipe, state.latents, x0)
    final = stopped.output.images[0]
    assert preview.size == final.size == (16, 16)  # the image's size, not the 8x8 latents'
    # exactly the image the pipeline makes of the same estimate when stopped there
    assert np.array_equal(_pixels(preview), _pixels(final))
    # and nearer the finished image than the noisy latents are, decoded or mapped
    target = _pixels(full.output.images[0])
    def off(image):
        return np.abs(_pixels(image.resize((16, 16))) - target).mean()
    assert off(preview) < off(decode_preview(demo_pipe, state.latents))
    assert off(preview) < off(latent_preview(state.latents))


def test_large_latents_get_the_linear_map_of_the_estimate(demo_pipe):
    x0 = torch.zeros(1, 4, 64, 64)  # a 512x512 Stable Diffusion image: no VAE decode per step
    noisy = torch.ones(1, 4, 64, 64)
    preview = estimate_preview(demo_pipe, noisy, x0)
    assert preview.size == (64, 64)
    assert np.array_equal(_pixels(preview), _pixels(latent_preview(x0)))
    assert estimate_preview(demo_pipe, torch.zeros(1, 16, 4096), None) is None  # packed latents: none


@pytest.mark.timeout(120)
def test_server_previews_have_the_images_size(server_backends):
    from stopcock.server.testing import sse_data

    with serving(server_backends, concurrency=1, queue_size=2, step_delay=0.01) as (url, _), \
            httpx.Client(base_url=url, timeout=60) as client:
        job = client.post("/v1/jobs", json={"kind": "image", "prompt": "a red square",
                                            "parameters": {"steps": 6, "seed": 1}}).json()
        with client.stream("GET", f"/v1/jobs/{job['id']}/events") as response:
            previews = [e for e in sse_data(response.iter_lines()) if e["type"] == "preview"]
        result = client.get(f"/v1/jobs/{job['id']}/result").json()["result"]
    import base64
    import io

    from PIL import Image

    def size(data: str) -> tuple[int, int]:
        return Image.open(io.BytesIO(base64.b64decode(data))).size

    assert previews
    assert {size(p["image"]) for p in previews} == {size(result["image"])}


@pytest.fixture(scope="module")
def demo_url():
    with serving(load_backends(None, None), concurrency=1, queue_size=2, step_delay=0.02) as (base, _):
        yield base


@contextlib.contextmanager
def browser_page(url: str) -> Iterator[Any]:
    with chromium() as browser:
        page = browser.new_page()
        page.set_default_timeout(60_000)
        page.goto(url)
        page.locator("#models[data-state=known]").wait_for()
        yield page


@pytest.mark.timeout(240)
def test_the_page_names_the_served_models_and_offers_prompts_that_suit_them(demo_url):
    with browser_page(demo_url) as page:
        text_item = page.inner_text("#model-list li[data-kind=text]")
        image_item = page.inner_text("#model-list li[data-kind=image]")
        assert "stopcock-demo-text" in text_item and "Zen of Python" in text_item
        assert "stopcock-demo-image" in image_item and "handwritten digits" in image_item
        assert page.input_value("#prompt") == "Beautiful is better than"

        page.check("input[name=kind][value=image]")
        assert page.input_value("#prompt") == "7"
        page.fill("#steps", "12")
        page.click("#generate")
        page.locator("#status[data-state=completed]").wait_for()
        page.wait_for_function("document.getElementById('preview').naturalWidth === 16")
        shown = page.evaluate("""() => {
            const img = document.getElementById('preview');
            return [getComputedStyle(img).imageRendering, img.getBoundingClientRect().width];
        }""")
        assert shown[0] == "pixelated" and shown[1] >= 256  # 16 px drawn at least 16 times larger

        page.check("input[name=kind][value=text]")
        assert page.input_value("#prompt") == "Beautiful is better than"
        page.fill("#max-tokens", "40")
        image_job = page.get_attribute("#status", "data-job")
        page.click("#generate")
        page.wait_for_function("""(before) => {
            const status = document.getElementById('status');
            return status.dataset.job !== before && status.dataset.state === 'completed';
        }""", arg=image_job)
        assert "is better than" in page.inner_text("#output")  # the model knows the Zen of Python


@pytest.mark.timeout(240)
def test_other_models_get_general_prompts_and_an_unserved_kind_cannot_be_chosen(server_backends):
    only_text = {"text": server_backends["text"]}
    with serving(only_text, concurrency=1, queue_size=2) as (url, _), browser_page(url) as page:
        assert "tiny-text" in page.inner_text("#model-list li[data-kind=text]")
        assert page.locator("#model-list li[data-kind=image]").count() == 0
        assert page.input_value("#prompt") == "Once upon a time"
        assert page.is_disabled("input[name=kind][value=image]")
