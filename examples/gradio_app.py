"""A Gradio app with Stop, Skip and Stop-after-this buttons that keep the partial result on the page.

    pip install "stopcock[diffusers,transformers]" gradio
    python examples/gradio_app.py        # then open http://127.0.0.1:7860

Draw digits (one image per digit, a preview at every step) or write text (streamed as it is
generated), and stop whenever you like: the image or text made so far stays on the page, with how
the run ended. Each browser session has its own buttons (:class:`stopcock.gradio.Session`): Stop
ends the run at its next step; Skip ends the current digit and draws the next; Stop after this lets
the current digit finish and draws no more. Gradio's own ``cancels=`` is not used: it would drop
the partial result (its cancelled generator never yields again).

It runs offline on the demo models that ship with stopcock (a tiny Stable Diffusion trained on 8x8
digits, a tiny GPT-2 trained on the Zen of Python); pass your own to :func:`build`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # before gradio is imported: nothing phones home

import gradio as gr
import torch

from stopcock.gradio import Session
from stopcock.loading import load_image_pipeline, load_text_model, resolve_model

#: System fonts: the default theme would fetch its fonts from the web.
THEME = gr.themes.Default(font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])


def demo_models() -> tuple[Any, Any]:
    """The shipped demo models: a diffusers pipeline (prompts "0" to "9") and a text-generation pipeline."""
    from transformers import pipeline

    torch.set_num_threads(1)  # tiny models: more threads only add synchronisation
    model, tokenizer = load_text_model(resolve_model(None, "text"), quiet=True)
    return load_image_pipeline(resolve_model(None, "image"), quiet=True), pipeline(
        "text-generation", model=model, tokenizer=tokenizer
    )


def build(image_pipe: Any = None, text_pipe: Any = None) -> gr.Blocks:
    """The app over a diffusers pipeline and a text-generation pipeline (default: the demo models)."""
    if image_pipe is None or text_pipe is None:
        image_pipe, text_pipe = demo_models()

    with gr.Blocks(title="stopcock: a Stop button that keeps the result", analytics_enabled=False) as demo:
        session = gr.State(Session, delete_callback=Session.close)  # one per browser session
        gr.Markdown("## Stop a generation and keep what it made")
        with gr.Tab("Image"):
            digits = gr.Textbox("3 1 4", label="Digits to draw, '0' to '9' (an image each)", elem_id="digits")
            steps = gr.Slider(1, 1000, value=200, step=1, label="Denoising steps", elem_id="steps")
            draw = gr.Button("Draw", variant="primary", elem_id="draw")
            with gr.Row():
                image = gr.Image(label="Current image", type="pil", format="png", elem_id="image", height=256)
                gallery = gr.Gallery(label="Finished", format="png", elem_id="gallery", height=256, columns=4)
        with gr.Tab("Text"):
            prompt = gr.Textbox("Beautiful is", label="Prompt", elem_id="prompt")
            tokens = gr.Slider(1, 1000, value=300, step=1, label="New tokens at most", elem_id="tokens")
            write = gr.Button("Write", variant="primary", elem_id="write")
            text = gr.Textbox(label="Text", lines=8, elem_id="text")
        with gr.Row():
            stop = gr.Button("Stop", variant="stop", interactive=False, elem_id="stop")
            skip = gr.Button("Skip", interactive=False, elem_id="skip")
            after = gr.Button("Stop after this", interactive=False, elem_id="after")
        status = gr.Markdown(elem_id="status")
        notice = gr.Markdown(elem_id="notice")
        buttons = [draw, write, stop, skip, after]

        def enabled(running: bool) -> list[Any]:
            """While a run goes on: its Stop buttons on, the generate buttons off (and back after)."""
            return [gr.Button(interactive=not running)] * 2 + [gr.Button(interactive=running)] * 3

        async def draw_digits(digits: str, steps: float, session: Session) -> AsyncIterator[tuple[Any, ...]]:
            generator = torch.Generator().manual_seed(0)
            first = True
            async for view in session.stream(
                image_pipe, each=digits.split() or ["0"], num_inference_steps=int(steps),
                generator=generator, preview="decode", partial="denoised",
            ):
                yield (view.image, list(view.images), view.status, "" if first else gr.skip(),
                       *enabled(view.running))
                first = False

        async def write_text(prompt: str, tokens: float, session: Session) -> AsyncIterator[tuple[Any, ...]]:
            first = True
            async for view in session.stream(
                text_pipe, prompt, max_new_tokens=int(tokens), return_full_text=False
            ):
                yield view.text, view.status, "" if first else gr.skip(), *enabled(view.running)
                first = False

        draw.click(draw_digits, [digits, steps, session], [image, gallery, status, notice, *buttons])
        write.click(write_text, [prompt, tokens, session], [text, status, notice, *buttons])
        # plain functions, not cancels=: the generating event goes on to its last update
        stop.click(Session.stop, session, notice, queue=False)
        skip.click(Session.skip, session, notice, queue=False)
        after.click(Session.stop_after_item, session, notice, queue=False)
    return demo


if __name__ == "__main__":
    build().launch(server_name="127.0.0.1", theme=THEME)
