"""The load check's smallest run: concurrent clients stop or disconnect at random; no job is left
running or stuck, every job ends with the expected reason, and no worker thread leaks."""

from __future__ import annotations

from bench.load_server import run


def test_quick_load_check_passes():
    section = run(quick=True)
    assert section.data["problems"] == [] and section.data["records"] > 0
    assert "all checks passed" in section.markdown()
