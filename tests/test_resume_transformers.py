"""Text generation checkpointed and resumed from its KV cache is bit-identical to the run never
stopped (torch.equal on the token ids): generate and the text-generation pipeline, greedy and
sampling, batches, rows ended by a stop string or end of text, dynamic, static and sliding-window
caches, through a file. What cannot resume exactly is refused, or resumed by recompute and said so."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import stopcock
from tiny.text import sliding_window_model

NEW = 16

DECODING = {
    "greedy": {"do_sample": False},
    "sampling": {"do_sample": True, "top_k": 0, "temperature": 0.9},
    "sampling, 2 per prompt": {"do_sample": True, "top_k": 0, "num_return_sequences": 2},
}


@pytest.fixture
def batch(tokenizer):
    return tokenizer(["The quick brown fox", "Stop"], return_tensors="pt", padding=True)


def seeded(fn, seed: int = 1) -> Any:
    torch.manual_seed(seed)
    return fn()


@pytest.mark.parametrize("decoding", DECODING, ids=str)
def test_generate_resumes_bit_identically(text_model, batch, decoding, tmp_path):
    kwargs = {**batch, "max_new_tokens": NEW, **DECODING[decoding]}
    reference = seeded(lambda: text_model.generate(**kwargs))
    stopped = seeded(lambda: stopcock.run(text_model, **kwargs, stop=stopcock.max_steps(5), checkpoint=True))
    assert stopped.stopped and stopped.steps == 5 and stopped.checkpoint.steps == 5
    torch.manual_seed(99)  # the program's RNG moves on; sampling must continue from the stop's state
    resumed = stopcock.resume(text_model, stopped.checkpoint)
    assert resumed.resumed == {"from_step": 5, "saved_steps": 5, "exact": True, "how": "cache"}
    assert resumed.steps == NEW and resumed.row_reasons == ["length"] * reference.shape[0]
    assert torch.equal(resumed.output, reference)
    loaded = stopcock.Checkpoint.load(stopped.checkpoint.save(tmp_path / "text.safetensors"))
    torch.manual_seed(100)
    assert torch.equal(stopcock.resume(text_model, loaded).output, reference)
    assert "_stopcock_intercepted" not in vars(text_model) and type(text_model).__name__ == "GPT2LMHeadModel"


def test_sampling_differs_without_the_saved_rng_state(text_model, batch):
    """The hazard: the same continuation from another RNG state gives other tokens."""
    kwargs = {**batch, "max_new_tokens": NEW, **DECODING["sampling"]}
    reference = seeded(lambda: text_model.generate(**kwargs))
    stopped = seeded(lambda: stopcock.run(text_model, **kwargs, stop=stopcock.max_steps(5), checkpoint=True))
    stopped.checkpoint.state["generate"]["do_sample"] = False  # so that resume leaves the RNG alone
    torch.manual_seed(99)
    assert not torch.equal(stopcock.resume(text_model, stopped.checkpoint).output, reference)


def test_static_cache(text_model, batch):
    kwargs = {**batch, "max_new_tokens": NEW, "do_sample": False, "cache_implementation": "static"}
    reference = text_model.generate(**kwargs)
    stopped = stopcock.run(text_model, **kwargs, stop=stopcock.max_steps(6), checkpoint=True)
    assert stopped.checkpoint.state["generate"]["cache"].cls == "StaticCache"
    text_model.generate(**{**kwargs, "max_new_tokens": 3})  # a later call reuses (and overwrites) the cache
    assert torch.equal(stopcock.resume(text_model, stopped.checkpoint).output, reference)


def test_sliding_window_cache(tmp_path):
    model = sliding_window_model(window=4)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    reference = model.generate(prompt, max_new_tokens=14, do_sample=False)
    stopped = stopcock.run(
        model, prompt, max_new_tokens=14, do_sample=False, stop=stopcock.max_steps(8), checkpoint=True
    )
    layers = stopped.checkpoint.state["generate"]["cache"].attributes["layers"]
    assert {layer.cls for layer in layers} == {"DynamicSlidingWindowLayer"}
    loaded = stopcock.Checkpoint.load(stopped.checkpoint.save(tmp_path / "window.safetensors"))
    assert torch.equal(stopcock.resume(model, loaded).output, reference)


def _ending_rows(text_model, tokenizer, batch) -> tuple[dict[str, Any], Any, int]:
    """Sampling settings in which row 0 ends early at "end of text" (one of its own tokens, taken as
    eos) and row 1 later at a stop string: (the generate kwargs, the stop strings, row 1's last step)."""
    prompt_len = batch["input_ids"].shape[1]
    base = {**batch, "max_new_tokens": 24, **DECODING["sampling"], "tokenizer": tokenizer}
    plain = seeded(lambda: text_model.generate(**batch, max_new_tokens=24, **DECODING["sampling"]))
    new = plain[:, prompt_len:]
    at = next(i for i in range(3, 24) if int(new[0, i]) not in new[0, :i].tolist())
    eos = int(new[0, at])
    text = tokenizer.decode(new[1], skip_special_tokens=True)
    for i in range(8, len(text) - 2):
        word = text[i : i + 2]
        if not word.strip() or word in text[: i + 1]:
            continue
        kwargs, strings = {**base, "eos_token_id": eos}, stopcock.stop_strings([word])
        reference = seeded(lambda: stopcock.run(text_model, **kwargs, stop=strings))  # noqa: B023
        last = int((reference.output[1, prompt_len:] != tokenizer.pad_token_id).sum())
        if reference.row_reasons == ["eos", "stop_string"] and last > at + 2:
            return kwargs, strings, last
    raise AssertionError("no stop string ends row 1 after row 0 has ended")


def test_rows_ended_by_a_stop_string_or_end_of_text_stay_ended(text_model, tokenizer, batch):
    kwargs, strings, last = _ending_rows(text_model, tokenizer, batch)
    reference = seeded(lambda: stopcock.run(text_model, **kwargs, stop=strings))
    stopped = seeded(
        lambda: stopcock.run(
            text_model, **kwargs, stop=strings | stopcock.max_steps(last - 1), checkpoint=True
        )
    )
    assert stopped.checkpoint.state["generate"]["ended"] == [0]  # row 1 still runs when it is stopped
    torch.manual_seed(5)
    resumed = stopcock.resume(text_model, stopped.checkpoint, stop=strings)
    assert resumed.row_reasons == reference.row_reasons == ["eos", "stop_string"]
    assert torch.equal(resumed.output, reference.output)
    # Stopped at the step where the last row ended: nothing is left to continue.
    at_end = seeded(
        lambda: stopcock.run(text_model, **kwargs, stop=strings | stopcock.max_steps(last), checkpoint=True)
    )
    assert at_end.checkpoint.state["generate"]["ended"] == [0, 1]
    assert torch.equal(stopcock.resume(text_model, at_end.checkpoint, stop=strings).output, reference.output)


def test_text_generation_pipeline(text_pipe):
    kwargs = {"max_new_tokens": 10, "do_sample": False}
    reference = stopcock.run(text_pipe, "Once upon a time", **kwargs)
    stopped = stopcock.run(
        text_pipe, "Once upon a time", **kwargs, stop=stopcock.max_steps(4), checkpoint=True
    )
    seen = []
    resumed = stopcock.resume(text_pipe, stopped.checkpoint, on_step=seen.append)
    assert resumed.output == reference.output and resumed.steps == reference.steps == 10
    assert [s.step for s in seen] == list(range(5, 11))  # steps counted on from the checkpoint's


def test_text_generation_pipeline_over_a_list(text_pipe, tmp_path):
    prompts = ["Once upon a time", "The quick", "Hello"]
    kwargs = {"max_new_tokens": 8, "do_sample": False}
    reference = stopcock.run(text_pipe, prompts, **kwargs)
    stopped = stopcock.run(text_pipe, prompts, **kwargs, stop=stopcock.max_steps(11), checkpoint=True)
    assert stopped.extra["items"] == 2 and stopped.checkpoint.state["done"] == reference.output[:1]
    loaded = stopcock.Checkpoint.load(stopped.checkpoint.save(tmp_path / "list.safetensors"))
    resumed = stopcock.resume(text_pipe, loaded)
    assert resumed.output == reference.output and resumed.extra["items"] == 3
    assert resumed.steps == reference.steps == 24 and resumed.row_reasons == reference.row_reasons
    # stopped between two prompts: the next one starts afresh on resume
    between = stopcock.run(text_pipe, prompts, **kwargs, stop=stopcock.max_steps(8), checkpoint=True)
    assert between.checkpoint.state["generate"] is None and len(between.checkpoint.state["done"]) == 1
    assert stopcock.resume(text_pipe, between.checkpoint).output == reference.output


def test_a_completed_run_resumes_to_the_same_output(text_model, batch):
    completed = stopcock.run(text_model, **batch, max_new_tokens=6, do_sample=False, checkpoint=True)
    assert not completed.stopped and completed.checkpoint.steps == 6
    again = stopcock.resume(text_model, completed.checkpoint)
    assert torch.equal(again.output, completed.output) and again.steps == 6


@pytest.mark.parametrize(
    ("setting", "why"),
    [
        ({"num_beams": 2}, "beam search"),
        ({"output_scores": True, "return_dict_in_generate": True}, "scores"),
        ({"penalty_alpha": 0.6, "top_k": 4}, "contrastive"),
    ],
    ids=["beams", "scores", "contrastive"],
)
def test_what_cannot_resume_exactly_is_refused_with_the_reason(text_model, batch, setting, why):
    with pytest.raises(stopcock.CheckpointError, match=why):
        stopcock.run(text_model, **batch, max_new_tokens=4, **setting, checkpoint=True)
    assert "_stopcock_intercepted" not in vars(text_model)


def test_an_abort_inside_a_forward_resumes_by_recompute_and_says_so(text_model, batch):
    kwargs = {**batch, "max_new_tokens": NEW, "do_sample": False}
    reference = text_model.generate(**kwargs)
    signal, steps = stopcock.StopSignal(), []
    block = text_model.transformer.h[1]

    def stop_in_the_sixth_step(module, args):
        if len(steps) == 5:
            signal.stop("inside")

    handle = block.register_forward_pre_hook(stop_in_the_sixth_step)
    try:
        stopped = stopcock.run(
            text_model, **kwargs, stop=signal, mode="abort", on_step=steps.append, checkpoint=True
        )
    finally:
        handle.remove()
    assert stopped.reason == "inside" and stopped.steps == 5
    assert stopped.checkpoint.state["generate"]["cache"] is None  # half a forward: its cache is incomplete
    resumed = stopcock.resume(text_model, stopped.checkpoint)
    assert resumed.resumed == {"from_step": 5, "saved_steps": 5, "exact": False, "how": "recompute"}
    assert "not guaranteed bit-identical" in resumed.detail
    kept = batch["input_ids"].shape[1] + 5
    assert (
        torch.equal(resumed.output[:, :kept], reference[:, :kept]) and resumed.output.shape == reference.shape
    )


def test_a_tokenizer_is_given_again_after_a_file(text_model, tokenizer, batch, tmp_path):
    kwargs = {**batch, "max_new_tokens": NEW, "do_sample": False, "tokenizer": tokenizer}
    strings = stopcock.stop_strings(["zzz"])
    reference = stopcock.run(text_model, **kwargs, stop=strings)
    stopped = stopcock.run(text_model, **kwargs, stop=strings | stopcock.max_steps(3), checkpoint=True)
    loaded = stopcock.Checkpoint.load(stopped.checkpoint.save(tmp_path / "tok.safetensors"))
    assert loaded.live == ["tokenizer"]
    with pytest.raises(stopcock.CheckpointError, match=r"tokenizer=.*pass it again"):
        stopcock.resume(text_model, loaded, stop=strings)
    assert torch.equal(
        stopcock.resume(text_model, loaded, stop=strings, tokenizer=tokenizer).output, reference.output
    )


def test_a_stream_records_too(text_model, tokenizer, batch):
    from stopcock.events import Done

    with stopcock.stream(
        text_model,
        **batch,
        max_new_tokens=NEW,
        do_sample=False,
        tokenizer=tokenizer,
        stop=stopcock.max_steps(4),
        checkpoint=True,
    ) as events:
        done = next(e for e in events if isinstance(e, Done))
    resumed = stopcock.resume(text_model, done.outcome.checkpoint, tokenizer=tokenizer)
    assert torch.equal(resumed.output, text_model.generate(**batch, max_new_tokens=NEW, do_sample=False))
