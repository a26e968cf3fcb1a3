"""The server benchmark and the GPU check run (on their smallest configuration); nothing here checks
a timing: the server table measures both arms at every client count, every stop it sends is
answered with the job stopped, and ``make gpu-check`` skips cleanly without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from bench import gpu_check, server
from bench.common import quiet


@pytest.mark.timeout(600)
def test_the_server_table_measures_both_arms_at_each_client_count():
    with quiet():
        section = server.run(quick=True)
    clients = server.CLIENTS[:2]
    assert [row[0] for row in section.tables[0].rows] == [str(n) for n in clients]
    for n in clients:
        found = section.data[n]
        assert found["single"] > 0 and found["batched"] > 0 and math.isfinite(found["ratio"])
        assert len(found["acks"]["single"]) == len(found["acks"]["batched"]) == n
    assert section.data["image_ratio"] > 0 and section.tables[1].rows
    assert section.headline and "tokens/s" in section.headline[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_the_gpu_check_skips_cleanly_without_cuda(capsys):
    def written() -> int | None:
        return gpu_check.RESULTS.stat().st_mtime_ns if gpu_check.RESULTS.exists() else None

    before = written()
    assert gpu_check.main([]) == 0
    assert "gpu-check: skipped: no CUDA device" in capsys.readouterr().out
    assert written() == before  # the report is left as it is


@pytest.mark.timeout(600)
def test_the_gpu_check_runs_its_code_on_the_cpu_with_tiny_models(tmp_path):
    out = tmp_path / "RESULTS-gpu.md"
    with quiet():
        assert gpu_check.main(["--cpu-smoke", "--out", str(out)]) == 0
    report = out.read_text()
    assert "## GPU check" in report and "Server: batched text jobs" in report
    assert report.count("| float32 | causal LM") == 1 and report.count("| float32 | UNet") == 1
