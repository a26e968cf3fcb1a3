"""STC008: a bare ``except:`` around a model run in a loop swallows the stop."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..engine import SCOPES, Finding, Module, Rule

EXITS = frozenset({"exit", "_exit", "abort"})


class SwallowedStop(Rule):
    code = "STC008"
    name = "swallowed-stop"
    summary = (
        "a bare `except:` / `except BaseException` around a pipeline call in a loop: Ctrl+C"
        " and stopcock's `Abort` are swallowed"
    )
    explanation = """
        A run takes seconds to minutes, so a Ctrl+C lands inside it, raised as `KeyboardInterrupt`
        from the model's forward; stopcock's `mode="abort"` and the CLI's second Ctrl+C stop a run
        with `stopcock.Abort`, also a `BaseException` so that `except Exception` cannot swallow it. A
        bare `except:` (or `except BaseException`) around the call catches both, and the loop moves on
        to the next prompt: the batch job can no longer be stopped except by killing the process.

        Fires on a `try` inside a loop whose body calls a pipeline (diffusers or transformers),
        `generate()` of a transformers model or `stopcock.run`, when a handler catches everything and
        neither re-raises, nor leaves the loop (`break`, `return`, `sys.exit()`).
        """
    wrong = """
        pipe = StableDiffusionPipeline.from_pretrained("...")
        for prompt in prompts:
            try:
                images.append(pipe(prompt).images[0])
            except:                      # Ctrl+C here moves on to the next prompt
                print("failed", prompt)
        """
    right = """
        pipe = StableDiffusionPipeline.from_pretrained("...")
        for prompt in prompts:
            try:
                images.append(pipe(prompt).images[0])
            except Exception:            # KeyboardInterrupt and stopcock.Abort get through
                print("failed", prompt)
        """
    upstream = (
        "bids-apps/rsHRF#41: a bare `except:` in a processing loop caught KeyboardInterrupt, so the run could"
        " not be interrupted",
        "bitly/bitly-api-python#1: Ctrl+C inside a loop is caught by `except:` and the loop continues",
    )

    def check(self, module: Module) -> Iterator[Finding]:
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Try) or not module.enclosing_loops(node):
                continue
            runs = [
                n
                for stmt in node.body
                for n in _own_nodes(stmt)
                if isinstance(n, ast.Call) and module.is_run_call(n)
            ]
            if not runs:
                continue
            for handler in node.handlers:
                if _catches_everything(module, handler) and not _leaves(handler):
                    caught = "except:" if handler.type is None else f"except {module.text(handler.type)}:"
                    yield module.finding(
                        self,
                        handler,
                        f"`{caught}` around {module.text(runs[0].func)}(...) in a loop swallows"
                        f" KeyboardInterrupt"
                        " and stopcock.Abort, so Ctrl+C or a stop only moves on to the next item; catch"
                        " Exception instead, or re-raise",
                    )


def _own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    stack = [node]
    while stack:
        item = stack.pop()
        yield item
        if not isinstance(item, SCOPES):
            stack.extend(ast.iter_child_nodes(item))


def _catches_everything(module: Module, handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(k, ast.Name) and k.id == "BaseException" for k in kinds)


def _leaves(handler: ast.ExceptHandler) -> bool:
    """The handler re-raises, or leaves the loop or the program."""
    for node in (n for stmt in handler.body for n in _own_nodes(stmt)):
        if isinstance(node, (ast.Raise, ast.Break, ast.Return)):
            return True
        if isinstance(node, ast.Call):
            func = node.func
            name = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            if name in EXITS:
                return True
    return False
