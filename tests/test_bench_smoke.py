"""Smoke test of the benchmarks: each runs once on its smallest configuration (``--quick``).

Benchmarks are not tests, so nothing here checks a timing. It checks that every benchmark runs,
measures every arm (stopcock's included), and that the behaviour its numbers rest on holds: each
stop lands before the end, abort mode does no more steps than finish mode, no denoiser or decoder
forward starts after a stop, and the partial result is what was asked for.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from bench import instructions
from bench.__main__ import BENCHMARKS, main, render, run_benchmarks
from bench.common import (
    CPU,
    Table,
    balanced_orders,
    cluster_median_ci,
    interleaved,
    machine_info,
    median_ci,
    quiet,
)
from bench.latency import ARMS
from bench.overhead import AA, ABORT, FINISH, NATIVE, PLAIN, Throughput, counted_rows, in_fresh_process


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_balanced_orders_put_every_arm_everywhere_and_after_every_other_arm_equally(n: int):
    orders = balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    positions = Counter((arm, i) for order in orders for i, arm in enumerate(order))
    after = Counter(pair for order in orders for pair in pairwise(order))
    assert len(positions) == n * n and len(set(positions.values())) == 1
    assert len(after) == n * (n - 1) and len(set(after.values())) == 1


def test_interleaved_calls_each_arm_once_a_round_in_the_balanced_orders():
    calls: list[str] = []
    arms = {name: (lambda name=name: calls.append(name) or name) for name in "abc"}
    results = interleaved(arms, 6, warmup=0)
    assert results == {name: [name] * 6 for name in "abc"}
    assert calls == ["abc"[i] for order in balanced_orders(3) for i in order]


def test_the_cluster_bootstrap_widens_the_interval_by_what_differs_between_processes():
    rng = random.Random(0)
    groups = [[1 + shift + rng.gauss(0, 0.001) for _ in range(50)] for shift in (0, 0.01, 0.02, 0.03)]
    pooled = [v for g in groups for v in g]
    lo, hi = cluster_median_ci(groups)
    plo, phi = median_ci(pooled)
    assert lo <= plo <= phi <= hi and hi - lo > 2 * (phi - plo)  # the pooled CI ignores the shifts
    assert cluster_median_ci(groups) == (lo, hi)  # seeded
    assert cluster_median_ci(groups[:1]) == median_ci(groups[0])


def test_a_share_of_rounds_runs_in_a_fresh_process():
    times = in_fresh_process(Throughput("generate", 2), CPU, rounds=1)
    assert times.keys() >= {PLAIN, "`run`, mode=finish", "`run`, mode=abort"} and len(times) == 5
    assert all(len(calls) == 1 and wall > 0 and cpu > 0 for calls in times.values() for wall, cpu in calls)


def test_a_callgrind_dump_is_read_as_each_function_s_own_instructions():
    # main runs 10, calls mkl_blas_avx2_sgemm (the 100 after calls= is the callee's), then runs 5 more
    dump = "events: Ir\nfn=(1) main\n3 10\ncfn=(2) mkl_blas_avx2_sgemm\ncalls=1 0\n+1 100\n+2 5\n"
    dump += "fn=(2)\n0 100\n"
    assert instructions.self_costs(dump) == {"main": 15, "mkl_blas_avx2_sgemm": 100}


@pytest.mark.skipif(instructions.missing() is not None, reason=f"counting {instructions.missing()}")
def test_each_arm_s_instructions_are_counted_under_callgrind():
    counted, _ = instructions.count_table(Throughput("generate", 2), rounds=1, warmup=1)
    counts = {name: calls[0] for name, calls in counted.counts.items()}
    assert counts.keys() == {PLAIN, AA, NATIVE, FINISH, ABORT}
    assert all(len(calls) == 1 for calls in counted.counts.values()) and counts[PLAIN] > 10**6
    assert abs(counts[AA] / counts[PLAIN] - 1) < 0.01  # the same call, counted twice: the allocators' noise
    assert counts[FINISH] > counts[PLAIN] and counts[ABORT] > counts[PLAIN]  # run's own work is in its count
    assert 0 < counted.avx2_share < 1
    # each count's instructions in the memory allocators, read from the same dump: a part of it
    assert all(0 < counted.allocators[name][0] < counts[name] // 10 for name in counts)
    table = Table("counted", [])
    rows = counted_rows(table, Throughput("generate", 2), counted)
    assert len(table.rows) == 5 and rows[PLAIN]["lean"]["ratio"] == 1
    assert rows[FINISH]["lean"]["added"] == (counts[FINISH] - counted.allocators[FINISH][0]) - (
        counts[PLAIN] - counted.allocators[PLAIN][0])


@pytest.mark.skipif(instructions.missing() is not None, reason=f"counting {instructions.missing()}")
def test_the_direct_per_call_costs_are_counted_under_callgrind():
    costs = instructions.count_checks(100)
    assert costs["criterion"] < costs["max_length"]  # stopcock's criterion against transformers' own
    assert abs(costs["module_unarmed"]) < 500 < costs["module_armed"]  # nothing installed until armed
    assert costs["step"] > 0 and costs["native_step"] > 0 and costs["record"] > 0


@pytest.fixture(scope="module")
def sections():
    with quiet():
        return dict(zip(BENCHMARKS, run_benchmarks(list(BENCHMARKS), quick=True), strict=True))


def test_every_benchmark_reports_tables(sections):
    for section in sections.values():
        assert section.tables and all(t.rows for t in section.tables), section.title
    text = render(list(sections.values()), machine_info(), "python -m bench --quick", 1.0)
    assert "| torch |" in text and "python -m bench --quick" in text
    assert all(s.title in text for s in sections.values())


def test_overhead_measures_stopcock_against_the_plain_call(sections):
    data = sections["overhead"].data
    for group in (data["text"], data["image"]):
        for arms in group.values():
            assert {"`run`, mode=finish", "`run`, mode=abort"} <= arms.keys()
            assert all(math.isfinite(a["ratio"]) and a["ratio"] > 0 for a in arms.values())
    assert data["checks"].keys() == {"step", "criterion", "block_hook"}
    assert data["implied"] and all(math.isfinite(v) for d in data["implied"].values() for v in d.values())
    # the in-place timing ran every arm through its loop model's calls (it raises if a call made too
    # few), on the text model through generate and the pipeline, and on the image call's UNet
    assert len(data["in_place"]) == 3
    for found in data["in_place"].values():
        for where in ("step", "fixed"):
            assert found[where].keys() == {PLAIN, AA, NATIVE, FINISH, ABORT}
            assert found[where][PLAIN] > 0 and all(math.isfinite(v) for v in found[where].values())


@pytest.mark.parametrize("name, scenario", [("latency", "image"), ("latency", "prefill"), ("blocks", None)])
def test_stops_land_before_the_end_and_abort_does_no_more_steps(sections, name, scenario):
    data = sections[name].data
    scenarios = [data[scenario]] if scenario else list(data.values())
    for result in scenarios:
        assert set(ARMS) <= result.keys()
        for arm in ARMS[1:]:
            assert result[arm]["forwards_after_stop"] == 0, arm
            assert result[arm]["latency_s"] > 0
        for arm in ARMS[2:]:  # stopcock reports its own stop latency
            assert result[arm]["reported_s"] is not None and result[arm]["reported_s"] > 0
        total = result["total"]
        assert result[ARMS[0]]["steps"] == total  # the run without a stop did every step
        assert result[ARMS[1]]["steps"] < total
        assert result[ARMS[3]]["steps"] <= result[ARMS[2]]["steps"] < total


def test_partial_results_are_what_was_asked(sections):
    (case,) = sections["partial"].data.values()
    assert case["another_seed_rmse"] > 0
    for stop in case["stops"]:
        assert stop["got"] == stop["asked"]  # DDIM gives an x0 estimate: no fallback to raw
        assert math.isfinite(stop["rmse"]) and math.isfinite(stop["latent_mse"])


def test_resume_benchmark_measures_resumes_that_are_exact(sections):
    data = sections["resume"].data
    assert all(r["exact"] for group in data["resume"].values() for r in group.values())
    assert set(data["tiny_bytes"]["measured"]) == {data["tiny_bytes"]["predicted"]}  # the shape formula holds
    assert all(math.isfinite(a["ratio"]) and a["ratio"] > 0 for a in data["overhead"].values())
def test_a_fast_forwarded_tail_is_measured_step_by_step(sections):
    (case,) = sections["fastforward"].data.values()
    assert case["path"] == "fast-forward" and case["fast_forwarded"] == len(case["forwarded"]) > 0
    assert case["computed"] and all(d > 0 for d in case["computed"] + case["forwarded"])


def test_the_report_opens_with_every_headline(sections):
    report = render(list(sections.values()), machine_info(), "python -m bench --quick", 1.0)
    summary = report.split("## Summary", 1)[1]
    headlines = [line for s in sections.values() for line in s.headline]
    assert headlines and all(f"- {line}" in summary for line in headlines)


def test_main_writes_the_report_where_asked(tmp_path: Path):
    out = tmp_path / "RESULTS.md"
    assert main(["--quick", "--only", "blocks", "--out", str(out)]) == 0
    assert "## 3. Per-block abort" in out.read_text()
    with pytest.raises(SystemExit):
        main(["--only", "nonsense"])


def test_a_standalone_report_names_its_command_and_fails_on_problems(tmp_path, capsys):
    from bench.common import Section, standalone_report

    section = Section("S", "intro", data={"problems": []})
    out = tmp_path / "R.md"
    assert standalone_report("t", "python -m bench.x --a", {"cores": "2"}, section, out) == 0
    text = out.read_text()
    assert text.startswith("# t\n\nGenerated by `python -m bench.x --a`. Do not edit: rerun it.\n")
    assert "| cores | 2 |" in text and "## S" in text and text == capsys.readouterr().out
    assert standalone_report("t", "c", {}, Section("S", "i", data={"problems": ["lost"]}), None) == 1
