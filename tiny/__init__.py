"""Tiny real models built offline from configs, for the tests and the benchmarks (not installed).

Nothing here downloads anything; weights are random unless a builder says otherwise.
``tiny.train`` remakes the demo models that ship in the package (``stopcock/tiny/``).
"""
