"""stopcock's benchmarks: ``python -m bench`` (or ``make bench``) writes ``bench/RESULTS.md``.

Benchmarks are not tests: they measure, as ratios within one run, what stopping costs and how fast
it takes effect compared with what users would do otherwise. CI runs only ``--quick`` (the smallest
configuration) through ``tests/test_bench_smoke.py``.
"""
