"""The demo models that ship with stopcock (``demo_model("text")``, ``demo_model("image")``).

The random-weight builders the tests and benchmarks use are not installed: they live in the
repository's top-level ``tiny/`` folder.
"""
