"""``stopcock check``: a linter for stop code that silently does nothing, before it runs.

One rule engine on the standard ``ast`` behind three front ends: ``stopcock check PATH...``
(:mod:`stopcock.lint.cli`), the flake8 plugin (:mod:`stopcock.lint.flake8`, codes ``STC0xx``) and
``--fix`` (:mod:`stopcock.lint.rewrite`). It imports no torch, diffusers or transformers; pipeline
facts come from :mod:`stopcock.pipeline_facts`, the source the runtime adapter uses too.
"""

from __future__ import annotations

from .checker import check_source, check_tree
from .engine import Finding, Rule
from .rules import RULES, rule

__all__ = ["RULES", "Finding", "Rule", "check_source", "check_tree", "rule"]
