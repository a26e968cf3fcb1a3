"""Shared fixtures: tiny real models built offline once per test session."""

from __future__ import annotations

import os
import signal

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# A test run started with Ctrl+C ignored (a background job of a script, nohup) would pass that on to
# the children of the Ctrl+C tests, which then never see the SIGINT they are sent and hang: with a
# handler here, each child starts with the default, as a program run from a terminal does.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory):
    from tiny.text import build_text_model

    return build_text_model(tmp_path_factory.mktemp("tiny-gpt2"))


@pytest.fixture(scope="session")
def text_model(text_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(text_model_dir).eval()


@pytest.fixture(scope="session")
def tokenizer(text_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(text_model_dir)


@pytest.fixture(scope="session")
def text_pipe(text_model, tokenizer):
    from transformers import pipeline

    return pipeline("text-generation", model=text_model, tokenizer=tokenizer)


# -- diffusers (tiny.image) --------------------------------------------------------------
@pytest.fixture(scope="session")
def image_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Stable Diffusion pipeline saved with save_pretrained (64x64 images)."""
    from tiny.image import build_image_model

    return build_image_model(tmp_path_factory.mktemp("tiny-sd"))


@pytest.fixture(scope="session")
def image_pipe(image_model_dir):
    """The saved tiny Stable Diffusion pipeline, loaded (progress bar off). Shared: do not modify."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(image_model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="session")
def server_backends(text_pipe, image_pipe):
    """The generation service's backends over the tiny models ("tiny-text", "tiny-sd")."""
    from stopcock.server.backends import ImageBackend, TextBackend

    return {"text": TextBackend(text_pipe, "tiny-text"), "image": ImageBackend(image_pipe, "tiny-sd")}


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (servers run several workers on few cores)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def count_forwards():
    """``count_forwards(*modules)``: a dict counting each module's completed forward calls, by module."""
    handles = []

    def install(*modules):
        counts = {m: 0 for m in modules}

        def hook(module, args, output):
            counts[module] += 1

        handles.extend(m.register_forward_hook(hook) for m in modules)
        return counts

    yield install
    for handle in handles:
        handle.remove()


# -- Ray Serve: one local cluster per test session, for the Ray engine's tests ------------------------
RAY_KEYS = ("alice-key", "bob-key")
RAY_APP = "stopcock"


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="session")
def ray_serve(text_model_dir, image_model_dir, tmp_path_factory):
    """The stopcock application on Ray Serve, on a local cluster started here (and shut down at the end
    of the session): the tiny models ("tiny-text": 2 replicas, "tiny-sd": 1), one pipeline per replica,
    2 ingress replicas, a queue of 16, keys ``RAY_KEYS``, the test-only step throttle of 0.01 s.

    Yields a namespace: ``url`` (the Serve proxy on 127.0.0.1), ``registry`` (a handle to the job
    registry), ``options`` (the :class:`~stopcock.server.ray_deploy.RayOptions`)."""
    pytest.importorskip("ray.serve")
    import types

    os.environ["RAY_AUTH_MODE"] = "disabled"  # a private cluster: no token file
    import ray
    from ray import serve

    from stopcock.server.ray_deploy import REGISTRY, RayOptions, build
    from stopcock.server.ray_engine.wire import ModelSpec

    ray.init(
        num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
        configure_logging=False,
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = RayOptions(
            models=[
                ModelSpec("text", str(text_model_dir), "tiny-text", ""),
                ModelSpec("image", str(image_model_dir), "tiny-sd", ""),
            ],
            api_keys=list(RAY_KEYS),
            replicas={"text": 2, "image": 1},
            ingress_replicas=2,
            model_actor_options={"num_cpus": 0},
            queue_size=16,
            step_delay=0.01,
            torch_threads=1,
            journal_dir=str(tmp_path_factory.mktemp("ray-journal")),
        )
        serve.run(build(options), name=RAY_APP, route_prefix="/")
        yield types.SimpleNamespace(
            url=f"http://127.0.0.1:{port}", registry=serve.get_deployment_handle(REGISTRY, RAY_APP),
            options=options,
        )
    finally:
        serve.shutdown()
        ray.shutdown()


# -- the command line (tests/test_cli*.py) ------------------------------------------------
CLI_PROMPT = "Beautiful is"


@pytest.fixture(scope="session")
def zen_text():
    """The demo text model's greedy continuation of CLI_PROMPT after n tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stopcock.tiny.demo import demo_model

    model = AutoModelForCausalLM.from_pretrained(demo_model("text")).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_model("text"))
    inputs = tokenizer(CLI_PROMPT, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1]:]
    return lambda n: tokenizer.decode(new[:n], skip_special_tokens=True)


@pytest.fixture
def run_main(capsys):
    """Run ``stopcock.cli.main(args)`` in this process (quicker): returns (exit code, stdout, stderr)."""

    def call(*args: str) -> tuple[int, str, str]:
        from stopcock.cli import main

        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return call


# -- the reliability suite (tests/test_reliability_*.py) -------------------------------------------
SOAK = os.environ.get("STOPCOCK_SOAK", "") == "1"


class Figures:
    """Trial counts of the reliability suite and what they measured.

    Bounded in CI; ``STOPCOCK_SOAK=1`` (``make soak``) runs the longer versions, and the figures
    recorded are printed at the end of the session, with the totals by kind of failure.
    """

    #: Kinds of failure, as the checks name them, by the total they count in.
    TOTALS = {
        "lost stops": ("children_never_stopped", "callbacks_not_run_exactly_once", "lost",
                       "wrong_exit_code_or_json"),
        "hangs": ("hangs",),
        "5xx": ("server_errors",),
        "leaks": ("threads_left", "hooks_left", "interrupt_flags_left"),
        "other failures": ("differ_from_alone",),
    }

    def __init__(self, soak: bool) -> None:
        self.soak = soak
        self.rows: list[tuple[str, int, str, dict[str, int], dict[str, int]]] = []

    def trials(self, ci: int, soak: int) -> int:
        return soak if self.soak else ci

    def record(self, check: str, trials: int, unit: str, *, failures: dict[str, int],
               seen: dict[str, int] | None = None) -> None:
        """One check: ``trials`` of ``unit``, the count of each kind of failure (a kind of
        :data:`TOTALS`), and what else was seen (counts that are not failures)."""
        unknown = set(failures) - {kind for kinds in self.TOTALS.values() for kind in kinds}
        assert not unknown, f"name these failures in Figures.TOTALS: {unknown}"
        self.rows.append((check, trials, unit, failures, seen or {}))

    def lines(self) -> list[str]:
        out = []
        for check, trials, unit, failures, seen in self.rows:
            counts = ", ".join(f"{n} {what}" for what, n in {**failures, **seen}.items())
            out.append(f"{check}: {trials:,} {unit}: {counts}")
        totals = {total: sum(f.get(kind, 0) for *_, f, _ in self.rows for kind in kinds)
                  for total, kinds in self.TOTALS.items()}
        trials = sum(row[1] for row in self.rows)
        out.append(f"total: {', '.join(f'{n} {total}' for total, n in totals.items())} in {trials:,} trials")
        return out


_FIGURES = Figures(SOAK)


@pytest.fixture(scope="session")
def figures() -> Figures:
    return _FIGURES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _FIGURES.rows:
        return
    terminalreporter.section("reliability figures" + (" (soak)" if SOAK else " (bounded; make soak: longer)"))
    for line in _FIGURES.lines():
        terminalreporter.write_line(line)
