"""STC005: ``generate()`` in a thread that nothing can stop, fed to a consumer that can leave."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ..engine import SCOPES, Finding, Module, Rule, keyword, same, walk_function
from ..resolve import Scope

STOPS = frozenset({"stopping_criteria", "max_time"})
FIX = (
    "pass stopping_criteria=stopcock.stopping_criteria(signal) to generate() and call signal.stop() when"
    " the consumer leaves (in a finally), or use stopcock.stream(model, ...), which stops the run when"
    " its loop is left"
)


class UnstoppableStreamer(Rule):
    code = "STC005"
    name = "unstoppable-streamer"
    summary = (
        "`generate()` in a thread with no stop, read through a `TextIteratorStreamer` by a"
        " consumer that can leave"
    )
    explanation = """
        `TextIteratorStreamer` has no cancel: `generate()` runs in its thread until `max_new_tokens`
        whatever the consumer does. A consumer loop that `break`s, `return`s or raises leaves the model
        generating for nobody, holding the GPU (and the next request waits behind it). A consumer that
        `yield`s (a Gradio or FastAPI streaming handler) is closed when the client goes away or Stop is
        pressed, with the same result.

        Fires when `threading.Thread(target=model.generate, kwargs=...)` (or a lambda or local function
        calling `generate`) is given a `TextIteratorStreamer` and no `stopping_criteria` or `max_time`,
        and the same function reads that streamer in a loop that can leave early (finding on the exit)
        or yields (finding on the thread). Keyword arguments that cannot be read (`**config`) keep it
        quiet. A loop that reads the streamer to the end in a plain script is fine and not reported.
        """
    wrong = """
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        Thread(target=model.generate, kwargs=dict(inputs, streamer=streamer, max_new_tokens=500)).start()
        for text in streamer:
            if "\\n\\n" in text:
                break            # generate() goes on to 500 tokens in its thread
        """
    right = """
        signal = stopcock.StopSignal()
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        criteria = stopcock.stopping_criteria(signal)
        Thread(target=model.generate,
               kwargs=dict(inputs, streamer=streamer, max_new_tokens=500, stopping_criteria=criteria)).start()
        try:
            for text in streamer:
                if "\\n\\n" in text:
                    break
        finally:
            signal.stop()        # the thread ends at its next token

        # or: for event in stopcock.stream(model, **inputs, tokenizer=tokenizer, max_new_tokens=500): ...
        """
    upstream = (
        "huggingface/transformers#27927: no way to terminate a TextIteratorStreamer before"
        " generation is done",
        "gradio-app/gradio#6724: Gradio's stop cannot stop the thread running generate()",
        "huggingface/transformers#31963: a streaming server keeps generating after the client disconnects",
        "oobabooga/text-generation-webui#1749: stopping a generate() thread blocked in a long call",
    )

    def check(self, module: Module) -> Iterator[Finding]:
        for call in module.calls:
            callee = module.value(call.func)
            if callee is None or callee.imported("threading") != "Thread":
                continue
            keys = self._generate_keys(module, call)
            if keys is None or STOPS & set(keys):
                continue
            streamer = keys.get("streamer")
            value = module.value(streamer)
            if streamer is None or value is None or value.kind != "streamer":
                continue
            function = module.resolver.enclosing_function(call)
            owner = function if function is not None else module.tree
            loops = [
                n
                for n in walk_function(owner)
                if isinstance(n, (ast.For, ast.AsyncFor)) and same(n.iter, streamer)
            ]
            exits = [e for loop in loops for e in _early_exits(loop)]
            if exits:
                kind = {ast.Break: "break", ast.Return: "return", ast.Raise: "raise"}[type(exits[0])]
                yield module.finding(
                    self,
                    exits[0],
                    f"this {kind} leaves the loop over the TextIteratorStreamer but generate()"
                    f" (thread started"
                    f" on line {call.lineno}) has no stop and runs on to max_new_tokens; {FIX}",
                )
            elif loops and any(
                isinstance(n, (ast.Yield, ast.YieldFrom)) for loop in loops for n in ast.walk(loop)
            ):
                yield module.finding(
                    self,
                    call,
                    "generate() runs in this thread with no stop while a generator streams its text: when the"
                    " generator is closed (client gone, Stop pressed) generation runs on to max_new_tokens;"
                    f" {FIX}",
                )

    def _generate_keys(self, module: Module, thread: ast.Call) -> dict[str, ast.expr] | None:
        """The keyword arguments the thread's ``generate()`` gets, or None if they cannot all be read."""
        target = keyword(thread, "target")
        if target is None:
            return None
        scope = module.resolver.scope_of(thread)
        if isinstance(target.value, ast.Attribute) and target.value.attr == "generate":
            given = keyword(thread, "kwargs")
            return _dict_keys(module, given.value, scope) if given is not None else {}
        body: ast.AST | None = None
        if isinstance(target.value, ast.Lambda):
            body = target.value.body
        else:
            function = module.resolver.function(target.value, scope)
            if function is not None:
                body = function
        generate = (
            [
                n
                for n in ast.walk(body)
                if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "generate"
            ]
            if body is not None
            else []
        )
        if len(generate) != 1:
            return None
        return _call_keys(module, generate[0], module.resolver.scope_of(generate[0]))


def _early_exits(loop: ast.For | ast.AsyncFor) -> list[ast.stmt]:
    """``break`` of this loop, ``return`` and ``raise`` in its body (not in nested loops' breaks or defs)."""
    found: list[ast.stmt] = []
    stack: list[tuple[ast.AST, bool]] = [(stmt, False) for stmt in loop.body]
    while stack:
        node, nested = stack.pop()
        if isinstance(node, ast.Break) and not nested:
            found.append(node)
        elif isinstance(node, (ast.Return, ast.Raise)):
            found.append(node)
        if isinstance(node, SCOPES):
            continue
        inner = nested or isinstance(node, (ast.For, ast.AsyncFor, ast.While))
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _call_keys(module: Module, call: ast.Call, scope: Scope) -> dict[str, ast.expr] | None:
    keys: dict[str, ast.expr] = {}
    for item in call.keywords:
        if item.arg is not None:
            keys[item.arg] = item.value
        else:
            spread = _dict_keys(module, item.value, scope)
            if spread is None:
                return None
            keys.update(spread)
    return keys


def _dict_keys(module: Module, expr: ast.expr, scope: Scope, depth: int = 0) -> dict[str, ast.expr] | None:
    """The keys of a dict built in the file (``{...}``, ``dict(...)``, a name bound once to one), or None.

    A positional mapping or ``**`` spread of model inputs (a tokenizer's or processor's output) holds
    tensors, not generation arguments; any other spread makes the keys unknown.
    """
    if depth > 3:
        return None
    if isinstance(expr, ast.Dict):
        keys: dict[str, ast.expr] = {}
        for key, value in zip(expr.keys, expr.values, strict=True):
            if key is None:
                spread = _spread(module, value, scope, depth)
                if spread is None:
                    return None
                keys.update(spread)
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                keys[key.value] = value
            else:
                return None
        return keys
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict":
        keys = {}
        for arg in expr.args:
            spread = _spread(module, arg, scope, depth)
            if spread is None:
                return None
            keys.update(spread)
        for item in expr.keywords:
            if item.arg is None:
                spread = _spread(module, item.value, scope, depth)
                if spread is None:
                    return None
                keys.update(spread)
            else:
                keys[item.arg] = item.value
        return keys
    if isinstance(expr, ast.Name):
        found = module.resolver.lookup(expr.id, scope)
        if found is None or len(found[0]) != 1 or not isinstance(found[0][0], ast.expr):
            return None
        keys_of = _dict_keys(module, found[0][0], found[1], depth + 1)
        if keys_of is None:
            return None
        return _with_changes(module, expr.id, found[1], keys_of)
    return None


def _spread(module: Module, expr: ast.expr, scope: Scope, depth: int) -> dict[str, ast.expr] | None:
    """What ``**expr`` (or a positional mapping) adds: nothing for model inputs, else its keys."""
    if _is_model_inputs(module, expr, scope):
        return {}
    return _dict_keys(module, expr, scope, depth + 1)


def _is_model_inputs(module: Module, expr: ast.expr, scope: Scope) -> bool:
    if isinstance(expr, ast.Name):
        found = module.resolver.lookup(expr.id, scope)
        if found is None or len(found[0]) != 1 or not isinstance(found[0][0], ast.expr):
            return False
        expr = found[0][0]
    while isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "to":
        expr = expr.func.value
    if not isinstance(expr, ast.Call):
        return False
    func = expr.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    owner = func.value if isinstance(func, ast.Attribute) else None
    owner_name = (
        owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
    )
    words = ("tokenizer", "processor", "tok")
    return any(w in name.lower() for w in words) or (
        name in ("apply_chat_template", "encode_plus", "batch_encode_plus", "__call__")
        and any(w in owner_name.lower() for w in words)
    )


def _with_changes(
    module: Module, name: str, scope: Scope, keys: dict[str, ast.expr]
) -> dict[str, ast.expr] | None:
    """``keys`` plus ``name["k"] = v`` assignments in the scope; None if ``name.update(...)`` changes it."""
    changed = dict(keys)
    for node in walk_function(scope.node):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and _is(node.func.value, name)
            and node.func.attr in ("update", "setdefault", "pop")
        ):
            if node.func.attr == "update":
                if len(node.args) != 1 or node.keywords:
                    if node.args or any(k.arg is None for k in node.keywords):
                        return None
                    changed.update({k.arg: k.value for k in node.keywords if k.arg is not None})
                    continue
                extra = _dict_keys(module, node.args[0], scope)
                if extra is None:
                    return None
                changed.update(extra)
            elif node.func.attr == "setdefault" and node.args and isinstance(node.args[0], ast.Constant):
                changed.setdefault(str(node.args[0].value), node.args[-1])
        if isinstance(node, ast.Subscript) and _is(node.value, name) and isinstance(node.ctx, ast.Store):
            if not (isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)):
                return None
            changed[node.slice.value] = node
    return changed


def _is(expr: ast.expr, name: str) -> bool:
    return isinstance(expr, ast.Name) and expr.id == name
