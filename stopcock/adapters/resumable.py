"""The one ``resume()`` of the adapters that checkpoint (:class:`~stopcock.adapters.base.Resumable`).

Every resume checks the checkpoint against the target (refused, with the differences named, when
they do not match), thaws the call it recorded with the arguments it could not keep, continues the
run in the adapter's own way (:meth:`ResumeScaffold.continued`: replay for diffusers, the saved cache
for transformers) and tells the Outcome how it resumed.
"""

from __future__ import annotations

from typing import Any

from ..checkpoint import Checkpoint, check_fingerprint, thaw
from ..control import RunControl
from ..outcome import Outcome

__all__ = ["ResumeScaffold"]


class ResumeScaffold:
    """``resume()`` for an adapter that says how it fingerprints a target and continues a run."""

    def fingerprint(self, target: Any) -> dict[str, Any]:
        """What a checkpoint of ``target`` must match to be resumed on it."""
        raise NotImplementedError

    def continued(
        self,
        target: Any,
        checkpoint: Checkpoint,
        control: RunControl,
        call: dict[str, Any],
        *,
        record: bool,
        **options: Any,
    ) -> tuple[Outcome, dict[str, Any]]:
        """Run ``target`` on from ``checkpoint`` with its thawed ``call``: the Outcome (carrying a new
        checkpoint when ``record``) and how it resumed (``saved_steps``, ``exact``, ``how``)."""
        raise NotImplementedError

    def resume(
        self,
        target: Any,
        checkpoint: Checkpoint,
        control: RunControl,
        given: dict[str, Any],
        *,
        record: bool = False,
        **options: Any,
    ) -> Outcome:
        """Continue ``checkpoint`` on ``target`` (see the module docstring)."""
        check_fingerprint(checkpoint, self.fingerprint(target))
        call = thaw(checkpoint.state["call"], given)
        outcome, how = self.continued(target, checkpoint, control, call, record=record, **options)
        outcome.resumed = {"from_step": checkpoint.steps, **how}
        return outcome
