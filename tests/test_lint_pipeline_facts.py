"""stopcock.pipeline_facts: the interrupt analysis against the survey's oracle, at run time and lint time."""

from __future__ import annotations

import ast
import csv
import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stopcock import pipeline_facts
from stopcock.pipeline_facts import function_honours_interrupt, pipeline_class

# The per-pipeline survey of diffusers 0.42.1 (copied from the project's shared reference material).
SURVEY = Path(__file__).with_name("diffusers-0.42.1-pipelines.csv")
ORACLE = Path(__file__).with_name("diffusers_interrupt.txt")

# Where the static analysis and the survey's list disagree, and why the analysis is right.
DISAGREEMENTS = {
    # Its denoise() loop checks interrupt, but __call__ runs denoise() once per tile inside
    # `for tile_index, tile in enumerate(tiles)`: after the flag every later tile skips all its steps
    # and is still assembled, so this is an inner-loop check like AnimateDiff's free-init.
    "LTX2DFRTemporalRefinePipeline": False,
}


def _oracle() -> set[str]:
    lines = ORACLE.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def _survey_rows() -> list[dict[str, str]]:
    with SURVEY.open() as handle:
        return list(csv.DictReader(handle))


def _expected(name: str, oracle: set[str]) -> bool:
    return DISAGREEMENTS.get(name, name in oracle)


def test_lint_time_analysis_agrees_with_the_oracle_for_every_surveyed_class():
    """From class names, in the installed diffusers' source, without importing diffusers (a fresh process)."""
    code = textwrap.dedent(
        f"""
        import csv, json, sys
        from stopcock.pipeline_facts import pipeline_class
        names = [row["pipeline"] for row in csv.DictReader(open({str(SURVEY)!r}))]
        facts = {{n: (c.honours_interrupt if (c := pipeline_class(n)) else None) for n in names}}
        heavy = [m for m in ("diffusers", "torch") if m in sys.modules]
        print(json.dumps({{"facts": facts, "imported": heavy}}))
        """
    )
    _survey_rows()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    report = json.loads(result.stdout)
    assert report["imported"] == []
    oracle = _oracle()
    found = {name: honours for name, honours in report["facts"].items() if honours is not None}
    assert len(found) == len(report["facts"])  # every surveyed class exists in the installed diffusers
    wrong = {name: honours for name, honours in found.items() if honours != _expected(name, oracle)}
    assert wrong == {}
    assert sum(found.values()) == len(oracle) - sum(1 for name in DISAGREEMENTS if name in oracle)


@pytest.mark.slow  # imports every pipeline module of diffusers (about 10 s)
def test_run_time_analysis_agrees_with_the_oracle_for_every_importable_class():
    """From class objects, as the adapter decides (the class in the MRO that defines __call__)."""
    from stopcock.adapters.diffusers import honours_interrupt

    oracle = _oracle()
    wrong = {}
    checked = 0
    for row in _survey_rows():
        if row["importable"] != "True":
            continue
        cls = getattr(importlib.import_module(row["module"]), row["pipeline"])
        pipe = cls.__new__(cls)  # no weights: honours_interrupt reads only the class
        checked += 1
        if honours_interrupt(pipe) != _expected(row["pipeline"], oracle):
            wrong[row["pipeline"]] = honours_interrupt(pipe)
    assert wrong == {} and checked > 250


def _function(source: str) -> ast.FunctionDef:
    node = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(node, ast.FunctionDef)
    return node


def test_the_check_must_be_at_the_top_of_a_loop_that_no_other_loop_encloses():
    top = _function(
        """
        def __call__(self):
            with self.progress_bar() as bar:
                for i, t in enumerate(timesteps):
                    if self.interrupt:
                        continue
                    step()
        """
    )
    inner = _function(
        """
        def __call__(self):
            for chunk in chunks:
                for t in timesteps:
                    if self.interrupt:
                        continue
                decode(chunk)
        """
    )
    both = _function(
        """
        def __call__(self):
            for window in windows:
                if self.interrupt:
                    break
                for t in timesteps:
                    if self._interrupt:
                        continue
        """
    )
    buried = _function(
        """
        def __call__(self):
            for t in timesteps:
                if ready:
                    if self.interrupt:
                        continue
        """
    )
    assert function_honours_interrupt(top)
    assert not function_honours_interrupt(inner)
    assert not function_honours_interrupt(both)  # the per-step loop is the inner one
    assert not function_honours_interrupt(buried)


def test_a_helper_called_outside_any_loop_counts_and_one_called_per_chunk_does_not():
    helper = _function(
        """
        def denoise(self):
            for t in timesteps:
                if self.interrupt:
                    continue
        """
    )
    once = _function("def __call__(self):\n    latents = self.denoise()\n    return latents\n")
    per_tile = _function("def __call__(self):\n    for tile in tiles:\n        self.denoise()\n")
    lookup = {"denoise": helper}.get
    assert function_honours_interrupt(once, lookup)
    assert not function_honours_interrupt(once)  # without the lookup the helper is not seen
    assert not function_honours_interrupt(per_tile, lookup)


def test_known_classes_read_from_source():
    sd = pipeline_class("StableDiffusionPipeline")
    lcm = pipeline_class("LatentConsistencyModelPipeline")
    audioldm2 = pipeline_class("AudioLDM2Pipeline")
    assert sd is not None and lcm is not None and audioldm2 is not None
    assert sd.honours_interrupt and sd.resets_interrupt and sd.var_kwargs
    assert sd.tensor_inputs_default == ("latents",) and "callback_on_step_end" in sd.parameters
    assert not lcm.honours_interrupt
    assert "max_new_tokens" in audioldm2.parameters and not audioldm2.var_kwargs
    assert pipeline_class("NoSuchPipeline") is None


def test_pipeline_class_names():
    for name in (
        "StableDiffusionPipeline",
        "DiffusionPipeline",
        "AutoPipelineForText2Image",
        "StableDiffusionPipelineSafe",
        "LEditsPPPipelineStableDiffusion",
    ):
        assert pipeline_facts.is_pipeline_class_name(name), name
    for name in (
        "StableDiffusionPipelineOutput",
        "ModularPipeline",
        "PipelineQuantizationConfig",
        "MultiPipelineCallbacks",
        "UNet2DConditionModel",
        "SequentialPipelineBlocks",
    ):
        assert not pipeline_facts.is_pipeline_class_name(name), name


def test_other_engine_names_are_unknown_to_transformers_generate():
    """Each name is neither a GenerationConfig field nor a generate() parameter, so generate refuses it."""
    import inspect

    from transformers import GenerationConfig, GenerationMixin

    config = GenerationConfig()
    parameters = set(inspect.signature(GenerationMixin.generate).parameters)
    for name in pipeline_facts.OTHER_ENGINE_ARGS:
        assert not hasattr(config, name) and name not in parameters, name
    for name in pipeline_facts.GENERATE_ONLY - {
        "streamer",
        "stopping_criteria",
        "logits_processor",
        "generation_config",
    }:
        assert hasattr(config, name), name
