"""GPU checks (skipped without CUDA) and the benchmarks' device options.

On a GPU: a run adds no host-device synchronisation per step (counted with torch's CUDA sync debug
mode against the plain call), a stop still lands, and ``python -m bench --quick --device cuda``
runs every table. Without one: asking the benchmarks for CUDA, or for float16 on the CPU, is a
clear command-line error, never a crash.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import stopcock
from bench.__main__ import main
from bench.common import Device
from bench.overhead import count_syncs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("argv", [["--dtype", "float16"], ["--dtype", "half"], ["--device", "tpu"]])
def test_bad_device_options_are_command_line_errors(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--quick", "--only", "overhead", *argv])
    assert info.value.code == 2 and "--d" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--device", "cuda"])
    assert "no CUDA device" in capsys.readouterr().err


@pytest.fixture(scope="module")
def gpu_model(text_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(text_model_dir).eval().to("cuda")


@cuda
@pytest.mark.parametrize("mode", ["finish", "abort"])
def test_a_run_adds_no_synchronisation_per_step(gpu_model, tokenizer, mode):
    ids = tokenizer(["Hello world"], return_tensors="pt").input_ids.to("cuda")

    def syncs(tokens: int, with_stopcock: bool) -> int:
        kwargs = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False}
        signal = stopcock.StopSignal()
        if with_stopcock:
            return count_syncs(lambda: stopcock.run(gpu_model, ids, stop=signal, mode=mode, **kwargs))
        return count_syncs(lambda: gpu_model.generate(ids, **kwargs))

    added_short = syncs(8, True) - syncs(8, False)
    added_long = syncs(16, True) - syncs(16, False)
    assert added_long == added_short  # a constant per call (the row reasons at the end), nothing per step


@cuda
def test_a_stop_lands_on_the_gpu(gpu_model, tokenizer):
    ids = tokenizer(["Hello world"], return_tensors="pt").input_ids.to("cuda")
    outcome = stopcock.run(gpu_model, ids, max_new_tokens=20, do_sample=False, stop=stopcock.max_steps(5))
    assert (outcome.stopped, outcome.steps) == (True, 5) and outcome.output.device.type == "cuda"


@cuda
def test_the_benchmarks_run_on_the_gpu(tmp_path: Path):
    out = tmp_path / "RESULTS-cuda.md"
    assert main(["--quick", "--device", "cuda", "--dtype", "float16", "--out", str(out)]) == 0
    text = out.read_text()
    assert "Host-device synchronisations" in text and Device.checked("cuda", "float16").cuda
