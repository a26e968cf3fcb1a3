"""STC001: transformers generate() arguments passed to a diffusers pipeline."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ...pipeline_facts import GENERATE_ONLY, pipeline_class
from ..engine import Finding, Fix, Module, Rule
from ..rewrite import call_without, statement_of, todo_comment


class GenerateArgsToDiffusers(Rule):
    code = "STC001"
    name = "generate-args-to-diffusers"
    summary = (
        "transformers `generate()` arguments (`stopping_criteria`, `max_new_tokens`, ...)"
        " passed to a diffusers pipeline"
    )
    explanation = """
        Diffusers pipelines have no `stopping_criteria`, `max_new_tokens`, `max_time`, `stop_strings`,
        `streamer`, ...: the pipelines that take `**kwargs` (Stable Diffusion, SDXL and their img2img,
        inpaint and ControlNet variants, Kandinsky 3, LCM, PixArt: 45 in diffusers 0.42.1) swallow them
        without a word, and the others raise `TypeError` only when the call runs. A stop passed this way
        never stops anything. Fires for pipelines of any class (`DiffusionPipeline.from_pretrained`,
        `AutoPipelineFor...` included) unless the class is known and declares the parameter itself
        (AudioLDM2 has its own `max_new_tokens`).

        `--fix` removes the arguments. Where the stop is a plain time limit (`max_time=T`, or
        `stopping_criteria` holding only `MaxTimeCriteria(T)`) and the class is known to honour
        interrupt, it rewrites the call to `stopcock.run(pipe, ..., stop=stopcock.timeout(T)).output`,
        which ends the denoising at the next step after T seconds and decodes. Otherwise it leaves a
        `# TODO(stopcock)` comment: what the stop was meant to do cannot be read from the code.
        """
    wrong = """
        pipe = StableDiffusionPipeline.from_pretrained("...")
        image = pipe("a cat", stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(10)])).images[0]
        """
    right = """
        pipe = StableDiffusionPipeline.from_pretrained("...")
        image = stopcock.run(pipe, "a cat", stop=stopcock.timeout(10)).output.images[0]
        """
    upstream = (
        "huggingface/diffusers#870: unused keyword arguments got a warning in `from_pretrained`, never in a"
        " pipeline call (a survey of diffusers 0.42.1 found 45 pipelines that take `**kwargs` and drop"
        " `stopping_criteria` silently)",
    )
    fixable = True

    def check(self, module: Module) -> Iterator[Finding]:
        for call in module.calls:
            pipeline = module.pipeline_of(call)
            if pipeline is None:
                continue
            facts = pipeline_class(pipeline.name) if pipeline.name else None
            declared = facts.parameters if facts is not None else frozenset()
            wrong = [k for k in call.keywords if k.arg in GENERATE_ONLY and k.arg not in declared]
            if not wrong:
                continue
            names = ", ".join(f"`{k.arg}=`" for k in wrong)
            who = pipeline.name or "a diffusers pipeline"
            effect = (
                "raises TypeError when called"
                if facts is not None and not facts.var_kwargs
                else "ignores it silently (it takes **kwargs)"
                if facts is not None
                else "ignores it silently or raises TypeError, by class"
            )
            message = (
                f"{names} {'is a' if len(wrong) == 1 else 'are'} transformers generate() argument"
                f"{'' if len(wrong) == 1 else 's'}: {who} {effect}, so this never stops it; stop it with"
                " stopcock.run(pipe, ..., stop=...) or callback_on_step_end=stopcock.step_callback(stop)"
            )
            yield module.finding(self, wrong[0], message, self._fix(module, call, wrong, facts))

    @staticmethod
    def _fix(module: Module, call: ast.Call, wrong: list[ast.keyword], facts: object) -> Fix | None:
        limit = _time_limit(module, wrong)
        statement = statement_of(module, call)
        if statement is None:
            return None
        names = ", ".join(f"{k.arg}=" for k in wrong)
        honours = getattr(facts, "honours_interrupt", False)
        if limit is not None and honours:
            stop = f"stop=stopcock.timeout({module.text(limit)})"
            edit = call_without(module, call, wrong, wrap="stopcock.run", extra=stop, suffix=".output")
            return Fix(
                f"remove {names}; run through stopcock.run with a timeout", (edit,), ("import stopcock",)
            )
        edit = call_without(module, call, wrong)
        note = todo_comment(
            module,
            statement,
            f"{names} never reached this pipeline; stop it with stopcock.run(pipe, ..., stop=...)",
        )
        return Fix(f"remove {names}", (note, edit))


def _time_limit(module: Module, wrong: list[ast.keyword]) -> ast.expr | None:
    """The seconds of a stop that is only a time limit (``max_time=T`` or ``[MaxTimeCriteria(T)]``)."""
    limits = []
    for keyword in wrong:
        if keyword.arg == "max_time":
            limits.append(keyword.value)
        elif keyword.arg == "stopping_criteria":
            held = keyword.value
            if isinstance(held, ast.Call) and held.args and not held.keywords:
                outer = module.value(held.func)
                if outer is not None and outer.imported("transformers") == "StoppingCriteriaList":
                    held = held.args[0]
            items = held.elts if isinstance(held, (ast.List, ast.Tuple)) else []
            if len(items) != 1 or not isinstance(items[0], ast.Call) or len(items[0].args) != 1:
                return None
            criterion = module.value(items[0].func)
            if (
                criterion is None
                or criterion.imported("transformers") != "MaxTimeCriteria"
                or items[0].keywords
            ):
                return None
            limits.append(items[0].args[0])
        else:
            return None  # another generate() argument: what was meant is not a time limit alone
    return limits[0] if len(limits) == 1 else None
