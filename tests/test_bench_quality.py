"""bench.quality: its report section and measures (the full run is ``python -m bench.quality``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import quality


def test_its_section_is_replaced_in_place_and_the_rest_kept(tmp_path, monkeypatch):
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n\n## 1. Other\n\nkept\n")
    monkeypatch.setattr(quality, "RESULTS", results)
    quality._write({"repetition": "table one\n"})
    quality._write({"converged": "table two\n"})
    quality._write({"repetition": "table one, again\n"})
    text = results.read_text()
    assert text.startswith("# results\n\n## 1. Other\n\nkept\n")
    assert text.count(quality.START) == 1 and text.count(quality.END) == 1
    assert "table one, again" in text and "table two" in text and "table one\n" not in text
    assert text.index("table one, again") < text.index("table two")


def test_diversity_is_the_mean_distance_within_each_digit():
    x = np.array([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0], [1.0, 1.0]])
    labels = np.array([0, 0, 1, 1])
    assert quality._diversity(x, labels) == pytest.approx((5.0 + 0.0) / 2)


@pytest.mark.timeout(300)
def test_the_repetition_table_on_the_models():
    torch.set_num_threads(1)
    (table,) = quality.bench_repetition()
    default = table.rows[0]
    assert default[0] == "4, 3, 64 (default)"
    assert default[4].startswith("0 (") and default[5] == "yes"  # no row that does not loop changed
    assert all(row[5] == "yes" for row in table.rows)  # a kept row is always the full row's start
