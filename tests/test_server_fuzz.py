"""No input gives a 500: schemathesis fuzzes every operation of the app's OpenAPI schema.

Valid and invalid inputs (schemathesis' positive and negative modes); bounded and deterministic: a
few examples per operation and mode, ``derandomize=True``. The models are the
real tiny ones; every job is capped at two steps (a ``max_steps`` condition added to its stop
conditions) so that generated boundary values such as 1024 tokens or 200 steps at 512x512 stay fast.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error

from stopcock.outcome import Outcome
from stopcock.server.app import create_app
from stopcock.server.contract import Backend, JobSpec, RunContext
from stopcock.server.engine import LocalEngine


class TwoSteps:
    """A real backend whose jobs stop after at most two steps."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.kind, self.name, self.description = backend.kind, backend.name, backend.description

    def validate(self, spec: JobSpec) -> None:
        self.backend.validate(spec)

    def lane(self) -> Any:
        inner = self.backend.lane()

        class Lane:
            def execute(self, spec: JobSpec, ctx: RunContext) -> Outcome:
                steps = min(spec.stop.get("max_steps", 2), 2)
                return inner.execute(dataclasses.replace(spec, stop={**spec.stop, "max_steps": steps}), ctx)

        return Lane()


@pytest.fixture(scope="module")
def fuzzed_app(server_backends, one_torch_thread):
    engine = LocalEngine({k: TwoSteps(b) for k, b in server_backends.items()}, concurrency=1, queue_size=2)
    yield create_app(engine)
    engine.close()


def test_no_input_gives_a_server_error(fuzzed_app):
    api = schemathesis.openapi.from_asgi("/openapi.json", fuzzed_app)
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 10  # jobs (5), models, health, completions, chat, images
    fuzzed_invalid = set()
    for operation, mode in itertools.product(operations, schemathesis.GenerationMode):

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=8, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
        def no_server_error(case: Any) -> None:
            case.call_and_validate(checks=[not_a_server_error])

        if mode is schemathesis.GenerationMode.POSITIVE:
            no_server_error()
            continue
        try:
            no_server_error()
        except Unsatisfiable:  # no invalid input exists for it (e.g. only a string path parameter)
            continue
        fuzzed_invalid.add(operation.label)
    bodies = {
        "POST /v1/jobs",
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/images/generations",
    }
    assert bodies <= fuzzed_invalid
