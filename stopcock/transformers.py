"""stopcock's helpers for transformers, for code that calls ``generate`` itself.

``stopping_criteria(stop, tokenizer=None)`` is a ``StoppingCriteriaList`` to pass as
``model.generate(..., stopping_criteria=...)``; it is also ``stopcock.stopping_criteria``.
``stopcock.run(model_or_pipeline, ...)`` needs none of this. Importing this module imports transformers.
"""

from __future__ import annotations

from .adapters.transformers_criteria import stopping_criteria

__all__ = ["stopping_criteria"]
