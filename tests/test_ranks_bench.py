"""Smoke test of ``bench/ranks.py`` (``--quick``): every arm is measured over 2 real ranks, and the
behaviour its numbers rest on holds (a stop from rank 0 ends both ranks at the same token, with
equal outputs). Benchmarks are not tests: no timing is checked."""

from __future__ import annotations

import math

import pytest

from bench import ranks
from bench.__main__ import BENCHMARKS


@pytest.mark.timeout(ranks.LAUNCH_TIMEOUT + 60)
def test_the_ranks_benchmark_measures_every_arm_and_one_agreed_stop():
    assert BENCHMARKS["ranks"] == "bench.ranks"
    section = ranks.run(quick=True)
    data = section.data
    assert data["arms"].keys() == set(ranks.ARMS)
    assert all(math.isfinite(a["tps"]) and a["tps"] > 0 for a in data["arms"].values())
    assert data["stopped"] == [[True, "user", ranks.STOP_AT + 1]] * 2
    assert data["equal_outputs"]
    assert data["store_check_us"] > 0
    assert all(t.rows for t in section.tables) and section.headline
