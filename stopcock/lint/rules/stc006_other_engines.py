"""STC006: other engines' argument names passed to transformers ``generate()``."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ...pipeline_facts import OTHER_ENGINE_ARGS
from ..engine import Finding, Module, Rule
from ..resolve import GENERATING_TASKS


class OtherEngineArgs(Rule):
    code = "STC006"
    name = "other-engine-args"
    summary = (
        "names from vLLM/OpenAI/TGI (`max_tokens`, `stop`, `stop_token_ids`, `ignore_eos`,"
        " ...) passed to `generate()`"
    )
    explanation = """
        transformers' `generate()` does not know `max_tokens`, `stop`, `stop_token_ids`,
        `ignore_eos`, `n`, `presence_penalty`, ...: it hands unknown names to the model and raises
        `ValueError: The following model_kwargs are not used by the model` only when the call runs (a
        text-generation pipeline does the same), and `GenerationConfig(max_tokens=...)` keeps the
        name as an attribute that nothing reads. Code ported from vLLM, an OpenAI client or TGI fails
        late, or never limits what it meant to limit. The message gives the transformers name.

        Checked on `generate()` of models loaded with a transformers class (`AutoModelForCausalLM
        .from_pretrained(...)`, also `pipe.model`), calls of a generating `transformers.pipeline(...)`,
        and `GenerationConfig(...)`; other libraries' `generate()` (vLLM, mlx-lm, gpt4all) are left alone.
        """
    wrong = """
        model = AutoModelForCausalLM.from_pretrained("...")
        out = model.generate(**inputs, max_tokens=200, stop=["\\n\\n"])
        """
    right = """
        model = AutoModelForCausalLM.from_pretrained("...")
        out = model.generate(**inputs, max_new_tokens=200, stop_strings=["\\n\\n"], tokenizer=tokenizer)
        """
    upstream = ("InternLM/lagent#149: `max_tokens` renamed to `max_new_tokens` for the transformers backend",)

    def check(self, module: Module) -> Iterator[Finding]:
        for call in module.calls:
            target = self._target(module, call)
            if target is None:
                continue
            for item in call.keywords:
                if item.arg in OTHER_ENGINE_ARGS:
                    yield module.finding(
                        self,
                        item,
                        f"`{item.arg}=` is not a transformers generation argument; {target}; use"
                        f" {OTHER_ENGINE_ARGS[item.arg]}",
                    )

    @staticmethod
    def _target(module: Module, call: ast.Call) -> str | None:
        """What the call is, when it reaches transformers' generation (for the message), else None."""
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr == "generate":
            receiver = module.value(func.value)
            if receiver is not None and receiver.kind == "transformers_model":
                return "generate() raises ValueError for it when the call runs"
        value = module.value(func)
        if value is not None and value.kind == "transformers_pipeline" and value.name in GENERATING_TASKS:
            return "the pipeline hands it to generate(), which raises ValueError when the call runs"
        if value is not None and value.imported("transformers") == "GenerationConfig":
            return "GenerationConfig keeps it as an attribute that generate() never reads"
        return None
