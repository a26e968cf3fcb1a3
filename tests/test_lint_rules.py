"""Each rule of ``stopcock check`` on code that must fire and on look-alikes that must stay quiet."""

from __future__ import annotations

import textwrap

import pytest

from stopcock.lint import RULES, check_source


def found(source: str, code: str | None = None) -> list[tuple[int, str]]:
    """(line, code) of the findings in ``source``, only ``code``'s when given."""
    findings = check_source(textwrap.dedent(source))
    return [(f.line, f.code) for f in findings if code is None or f.code == code]


def messages(source: str, code: str) -> list[str]:
    return [f.message for f in check_source(textwrap.dedent(source)) if f.code == code]


SD = "from diffusers import StableDiffusionPipeline\npipe = StableDiffusionPipeline.from_pretrained('x')\n"


# -- STC001 generate-only arguments to a diffusers pipeline ---------------------------------------------
@pytest.mark.parametrize(
    "source",
    [
        SD + "pipe('a cat', stopping_criteria=[criteria])",
        SD + "pipe = pipe.to('cuda')\nimage = pipe(prompt, max_new_tokens=30).images[0]",
        "import diffusers\npipe = diffusers.DiffusionPipeline.from_pretrained('x').to('cuda')\n"
        "pipe('a', max_time=5)",
        "from diffusers import AutoPipelineForText2Image as Auto\np = Auto.from_pretrained('x')\n"
        "p('a', streamer=s)",
        "from diffusers import StableDiffusionXLPipeline\n"
        "p = StableDiffusionXLPipeline.from_single_file('m.safetensors')\np(prompt='a', stop_strings=['x'])",
        "from diffusers import StableDiffusionPipeline as SD\n"
        "class Gen:\n    def __init__(self):\n        self.pipe = SD.from_pretrained('x')\n"
        "    def __call__(self, p):\n        return self.pipe(p, max_new_tokens=4)",
        "from diffusers import FluxPipeline\n"
        "def run(pipe: FluxPipeline):\n    return pipe('a', stopping_criteria=c)",
    ],
)
def test_stc001_fires_on_generate_arguments_to_a_pipeline(source):
    assert [c for _, c in found(source)] == ["STC001"]


@pytest.mark.parametrize(
    "source",
    [
        # transformers' own pipeline takes these
        "from transformers import pipeline\npipe = pipeline('text-generation', model='gpt2')\n"
        "pipe('hi', max_new_tokens=20, stopping_criteria=c)",
        # AudioLDM2 declares max_new_tokens itself
        "from diffusers import AudioLDM2Pipeline\np = AudioLDM2Pipeline.from_pretrained('x')\n"
        "p('rain', max_new_tokens=8)",
        # a name rebound to something unknown: not judged
        SD + "pipe = load_other()\npipe('a', max_new_tokens=5)",
        # an unrelated object with the same name
        "pipe = make_pipeline()\npipe('a', max_new_tokens=5)",
        # the pipeline's own arguments
        SD + "pipe('a', num_inference_steps=20, guidance_scale=7.5)",
        # a model, not a pipeline
        "from diffusers import UNet2DConditionModel\n"
        "u = UNet2DConditionModel.from_pretrained('x')\nu(x, max_time=3)",
    ],
)
def test_stc001_stays_quiet(source):
    assert found(source, "STC001") == []


def test_stc001_says_whether_the_class_swallows_or_raises():
    swallowed = messages(SD + "pipe('a', max_time=3)", "STC001")[0]
    raises = messages(
        "from diffusers import FluxPipeline\np = FluxPipeline.from_pretrained('x')\np('a', max_time=3)",
        "STC001",
    )[0]
    assert "ignores it silently" in swallowed and "stopcock.run(pipe, ..., stop=...)" in swallowed
    assert "raises TypeError" in raises


# -- STC002 interrupt ------------------------------------------------------------------------------------
LCM = (
    "from diffusers import LatentConsistencyModelPipeline\n"
    "lcm = LatentConsistencyModelPipeline.from_pretrained('x')\n"
)


def test_stc002_fires_in_a_callback_given_to_a_pipeline_that_ignores_the_flag():
    source = LCM + textwrap.dedent(
        """
        def stop_at(pipeline, step, timestep, callback_kwargs):
            if step == 10:
                pipeline._interrupt = True
            return callback_kwargs

        lcm("a cat", callback_on_step_end=stop_at)
        """
    )
    assert found(source) == [(6, "STC002")]
    assert "LatentConsistencyModelPipeline never reads `_interrupt`" in messages(source, "STC002")[0]


def test_stc002_fires_on_the_object_and_on_an_annotated_callback_parameter():
    source = LCM + textwrap.dedent(
        """
        from diffusers import Kandinsky3Pipeline

        def on_stop():
            lcm._interrupt = True

        def cb(pipe: Kandinsky3Pipeline, i, t, kw):
            pipe._interrupt = True
            return kw
        """
    )
    assert found(source) == [(7, "STC002"), (10, "STC002")]


def test_stc002_fires_on_a_flag_set_before_the_call_that_resets_it():
    source = SD + textwrap.dedent(
        """
        for prompt in prompts:
            if cancelled:
                pipe._interrupt = True
            images.append(pipe(prompt).images[0])
        """
    )
    assert found(source) == [(6, "STC002")]
    assert "is lost" in messages(source, "STC002")[0]


@pytest.mark.parametrize(
    ("source", "where"),
    [
        # a Stop button's handler, on a class that honours the flag
        (SD + "def stop():\n    pipe._interrupt = True", "in stop()"),
        # a watcher thread
        (
            SD + "import threading\ndef watch(event):\n    event.wait()\n    pipe._interrupt = True\n"
            "threading.Thread(target=watch, args=(ev,)).start()",
            "in watch()",
        ),
        # a Gradio handler written as a lambda
        (SD + "stop_button.click(fn=lambda: setattr(pipe, '_interrupt', True))", "in a lambda"),
        # a pipeline kept on an object, its class known only at run time
        (
            "from diffusers import DiffusionPipeline\nclass App:\n    def __init__(self):\n"
            "        self.pipe = DiffusionPipeline.from_pretrained('x')\n"
            "    def cancel(self):\n        self.pipe._interrupt = True",
            "in cancel()",
        ),
        # module code between two calls
        (SD + "pipe('a')\nif cancelled:\n    pipe._interrupt = True", "at module level"),
    ],
)
def test_stc002_fires_on_a_flag_set_outside_a_step_callback(source, where):
    assert [c for _, c in found(source)] == ["STC002"]
    (message,) = messages(source, "STC002")
    assert f"outside a step callback ({where})" in message and "_interrupt = False" in message
    assert "StopSignal" in message and "stopcock.run(pipe, ..., stop=signal)" in message


@pytest.mark.parametrize(
    "source",
    [
        # the documented pattern, on a pipeline that honours it
        SD + "def cb(p, i, t, kw):\n    if i == 5:\n        p._interrupt = True\n    return kw\n"
        "pipe('a', callback_on_step_end=cb)",
        # a callback given elsewhere (a callback's four arguments), on the global pipeline
        SD + "def cb(p, i, t, kw):\n    pipe._interrupt = True\n    return kw",
        # a callback given here, on the global pipeline: read during the call
        SD + "def cb(p, i, t, kw):\n    if i == 5:\n        pipe._interrupt = True\n    return kw\n"
        "pipe('a', callback_on_step_end=cb)",
        # a callback bound with functools.partial, and a legacy callback
        SD + "import functools\ndef cb(event, p, i, t, kw):\n    if event.is_set():\n"
        "        pipe._interrupt = True\n    return kw\n"
        "pipe('a', callback_on_step_end=functools.partial(cb, ev))",
        SD + "def legacy(i, t, latents):\n    pipe._interrupt = True\npipe('a', callback=legacy)",
        # a method with a callback's arguments after self
        SD + "class S:\n    def cb(self, p, i, t, kw):\n        pipe._interrupt = True\n        return kw",
        # unknown class: not judged
        "from diffusers import DiffusionPipeline\np = DiffusionPipeline.from_pretrained('x')\n"
        "def cb(pl, i, t, kw):\n    pl._interrupt = True\n    return kw\np('a', callback_on_step_end=cb)",
        # resetting is harmless
        LCM + "lcm._interrupt = False\nlcm('a')",
        # an object that is not a pipeline
        "worker._interrupt = True\nworker()",
    ],
)
def test_stc002_stays_quiet(source):
    assert found(source, "STC002") == []


# -- STC003 callback contract -------------------------------------------------------------------------
def test_stc003_fires_on_a_path_without_return_and_an_undeclared_tensor():
    source = SD + textwrap.dedent(
        """
        def cb(pipe, step, timestep, callback_kwargs):
            if step == 10:
                pipe._interrupt = True
                return
            embeds = callback_kwargs["prompt_embeds"]
            return callback_kwargs

        pipe("a", callback_on_step_end=cb)
        """
    )
    assert found(source) == [(4, "STC003"), (11, "STC003")]
    assert (
        "AttributeError" in messages(source, "STC003")[0]
        and "'prompt_embeds'" in messages(source, "STC003")[1]
    )


def test_stc003_fires_on_a_callback_that_falls_off_its_end_and_a_factory_made_one():
    source = textwrap.dedent(
        """
        def progress(pipe, step, t, kwargs):
            bar.update(step)

        def make():
            def inner(pipe, step, t, kwargs):
                log(step)
            return inner

        generate(prompt, callback_on_step_end=progress)
        generate(prompt, callback_on_step_end=make())
        """
    )
    assert found(source) == [(2, "STC003"), (6, "STC003")]


def test_stc003_checks_a_pipeline_callback_class():
    source = textwrap.dedent(
        """
        from diffusers.callbacks import PipelineCallback

        class Cfg(PipelineCallback):
            tensor_inputs = ["prompt_embeds"]

            def callback_fn(self, pipeline, step_index, timestep, callback_kwargs):
                latents = callback_kwargs["latents"]
                return callback_kwargs
        """
    )
    assert found(source) == [(7, "STC003")]


@pytest.mark.parametrize(
    "source",
    [
        SD + "def cb(p, i, t, kw):\n    x = kw['prompt_embeds']\n    return kw\n"
        "pipe('a', callback_on_step_end=cb, callback_on_step_end_tensor_inputs=['latents', 'prompt_embeds'])",
        SD + "def cb(p, i, t, kw):\n    lat = kw['latents']\n    if i > 3:\n        raise StopRun()\n"
        "    return kw\n"
        "pipe('a', callback_on_step_end=cb)",
        # .get() never raises; tensor list not literal: not judged
        SD + "def cb(p, i, t, kw):\n    x = kw.get('add_text_embeds')\n    y = kw['prompt_embeds']\n"
        "    return kw\n"
        "pipe('a', callback_on_step_end=cb, callback_on_step_end_tensor_inputs=names)",
        # every branch returns
        "def cb(p, i, t, kw):\n    if i:\n        return kw\n    else:\n        return {}\n"
        "f(callback_on_step_end=cb)",
        # a legacy callback(step, t, latents) returns nothing by design
        SD + "def cb(step, t, latents):\n    print(step)\npipe('a', callback=cb, callback_steps=1)",
        # a method used as callback
        "class A:\n    def cb(self, p, i, t, kw):\n        return kw\n    def go(self):\n"
        "        self.pipe('a', callback_on_step_end=self.cb)",
    ],
)
def test_stc003_stays_quiet(source):
    assert found(source, "STC003") == []


# -- STC004 row 0 -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        "return input_ids[0, -1] == self.stop_id",
        "for stop in self.stops:\n    if torch.all(stop == input_ids[0][-len(stop):]).item():\n"
        "        return True\nreturn False",
        "last = input_ids[0][-1]\nif last in self.ids:\n    return True\nreturn False",
        "stop = self.stop.to(input_ids.device)\nreturn bool((input_ids[0][-len(stop):] == stop).all())",
    ],
)
def test_stc004_fires_on_a_bool_from_row_zero(body):
    source = (
        "from transformers import StoppingCriteria\nclass S(StoppingCriteria):\n"
        "    def __call__(self, input_ids, scores, **kwargs):\n" + textwrap.indent(body, " " * 8)
    )
    assert [c for _, c in found(source)] == ["STC004"]


@pytest.mark.parametrize(
    "body",
    [
        "return input_ids[:, -1] == self.stop_id",
        "done = [ids[-1] == self.stop for ids in input_ids]\nreturn torch.tensor(done)",
        "assert input_ids.shape[0] == 1\nreturn input_ids[0, -1] == self.stop_id",
        "return self.event.is_set()",
        "return torch.full((input_ids.shape[0],), self.flag, dtype=torch.bool)",
        "return self.decide(input_ids[0])",
    ],
)
def test_stc004_stays_quiet_on_per_row_or_batch_free_criteria(body):
    source = (
        "from transformers import StoppingCriteria\nclass S(StoppingCriteria):\n"
        "    def __call__(self, input_ids, scores, **kwargs):\n" + textwrap.indent(body, " " * 8)
    )
    assert found(source, "STC004") == []


def test_stc004_needs_a_transformers_stopping_criteria():
    source = "class S:\n    def __call__(self, input_ids, scores):\n        return input_ids[0, -1] == 2"
    assert found(source) == []


# -- STC005 streamer / thread ---------------------------------------------------------------------------
STREAM = """
from threading import Thread
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

model = AutoModelForCausalLM.from_pretrained("m")
tokenizer = AutoTokenizer.from_pretrained("m")
"""


def test_stc005_fires_on_a_break_out_of_the_streamer_loop():
    source = STREAM + textwrap.dedent(
        """
        def reply(prompt):
            inputs = tokenizer([prompt], return_tensors="pt")
            streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
            thread = Thread(target=model.generate, kwargs=dict(inputs, streamer=streamer, max_new_tokens=500))
            thread.start()
            text = ""
            for chunk in streamer:
                text += chunk
                if "\\n\\n" in text:
                    break
            return text
        """
    )
    assert found(source) == [(17, "STC005")]


def test_stc005_fires_on_a_generator_that_streams_from_an_unstoppable_thread():
    source = STREAM + textwrap.dedent(
        """
        def chat(message, history):
            streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
            generate_kwargs = {"input_ids": ids, "streamer": streamer, "max_new_tokens": 1024}
            t = Thread(target=model.generate, kwargs=generate_kwargs)
            t.start()
            partial = ""
            for new_token in streamer:
                partial += new_token
                yield partial
        """
    )
    assert found(source) == [(11, "STC005")]


@pytest.mark.parametrize(
    "extra",
    [
        "stopping_criteria=StoppingCriteriaList([stop])",  # stoppable
        "max_time=30",  # bounded in time
        "**config",  # cannot be read: quiet
    ],
)
def test_stc005_stays_quiet_when_the_thread_can_be_stopped_or_is_unknown(extra):
    source = STREAM + textwrap.dedent(
        f"""
        def chat(message):
            streamer = TextIteratorStreamer(tokenizer)
            Thread(target=model.generate, kwargs=dict(input_ids=ids, streamer=streamer, {extra})).start()
            for token in streamer:
                if token == "x":
                    break
                yield token
        """
    )
    assert found(source, "STC005") == []


def test_stc005_stays_quiet_on_a_script_that_reads_to_the_end():
    source = STREAM + textwrap.dedent(
        """
        inputs = tokenizer(["An increasing sequence: one,"], return_tensors="pt")
        streamer = TextIteratorStreamer(tokenizer)
        thread = Thread(target=model.generate, kwargs=dict(inputs, streamer=streamer, max_new_tokens=20))
        thread.start()
        generated_text = ""
        for new_text in streamer:
            generated_text += new_text
        """
    )
    assert found(source) == []


# -- STC006 other engines' names -------------------------------------------------------------------------
def test_stc006_fires_on_generate_a_text_generation_pipeline_and_generation_config():
    source = textwrap.dedent(
        """
        import transformers
        from transformers import AutoModelForCausalLM, GenerationConfig

        model = AutoModelForCausalLM.from_pretrained("m").eval()
        model.generate(**inputs, max_tokens=100, stop=["\\n"])
        pipe = transformers.pipeline("text-generation", model="m")
        pipe("hi", stop_token_ids=[2])
        pipe.model.generate(ids, ignore_eos=True)
        config = GenerationConfig(n=2)
        """
    )
    assert found(source) == [(6, "STC006"), (6, "STC006"), (8, "STC006"), (9, "STC006"), (10, "STC006")]
    assert "use max_new_tokens=" in messages(source, "STC006")[0]


@pytest.mark.parametrize(
    "wrap",
    [
        "from peft import get_peft_model\nmodel = get_peft_model(model, config)",
        "import peft\nmodel = peft.get_peft_model(model, config)",
        "from peft import PeftModel\nmodel = PeftModel.from_pretrained(model, 'adapter')",
    ],
)
def test_stc006_follows_a_model_through_peft(wrap):
    source = (
        "from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained('m')\n"
        f"{wrap}\nmodel.generate(**inputs, max_tokens=50)\n"
    )
    assert found(source, "STC006") == [(len(source.splitlines()), "STC006")]


def test_stc006_does_not_guess_what_peft_wraps():
    source = (
        "from peft import get_peft_model\nmodel = get_peft_model(load(), config)\n"
        "model.generate(max_tokens=5)"
    )
    assert found(source, "STC006") == []


@pytest.mark.parametrize(
    "source",
    [
        "from vllm import LLM, SamplingParams\nllm = LLM('m')\n"
        "llm.generate(p, SamplingParams(max_tokens=5, stop=['x']))",
        "from gpt4all import GPT4All\nm = GPT4All('m')\nm.generate('hi', max_tokens=10)",
        "from mlx_lm import load, generate\nmodel, tok = load('m')\n"
        "generate(model, tok, prompt='x', max_tokens=9)",
        "from transformers import AutoModelForCausalLM\nm = AutoModelForCausalLM.from_pretrained('m')\n"
        "m.generate(**inputs, max_new_tokens=5, stop_strings=['x'], tokenizer=tok)",
        "from transformers import pipeline\nclf = pipeline('text-classification')\nclf('x', top_k=2)",
    ],
)
def test_stc006_stays_quiet(source):
    assert found(source, "STC006") == []


# -- STC007 reused MaxTimeCriteria --------------------------------------------------------------------
MODEL = (
    "from transformers import AutoModelForCausalLM, MaxTimeCriteria, StoppingCriteriaList\n"
    "model = AutoModelForCausalLM.from_pretrained('m')\n"
)


@pytest.mark.parametrize(
    "source",
    [
        MODEL + "criteria = StoppingCriteriaList([MaxTimeCriteria(30)])\nfor p in prompts:\n"
        "    out = model.generate(**enc(p), stopping_criteria=criteria)",
        MODEL + "limit = MaxTimeCriteria(10)\nwhile True:\n"
        "    model.generate(ids, stopping_criteria=[limit, other])",
        MODEL + "class Bot:\n    def __init__(self):\n"
        "        self.criteria = StoppingCriteriaList([MaxTimeCriteria(5)])\n"
        "    def reply(self, ids):\n        return model.generate(ids, stopping_criteria=self.criteria)",
        MODEL + "criteria = [MaxTimeCriteria(20)]\n@app.post('/generate')\ndef generate(req):\n"
        "    return model.generate(req.ids, stopping_criteria=criteria)",
    ],
)
def test_stc007_fires_on_a_criteria_built_once_and_reused(source):
    assert [c for _, c in found(source)] == ["STC007"]


@pytest.mark.parametrize(
    ("source", "why"),
    [
        # at module level, used by a function others call (a library's helper)
        (
            MODEL + "criteria = StoppingCriteriaList([MaxTimeCriteria(30)])\ndef reply(ids):\n"
            "    return model.generate(ids, stopping_criteria=criteria)",
            "reply is called from outside this file",
        ),
        # ... called twice, or in a loop
        (
            MODEL + "limit = MaxTimeCriteria(30)\ndef reply(ids):\n"
            "    return model.generate(ids, stopping_criteria=[limit])\nreply(a)\nreply(b)",
            "reply is called on lines",
        ),
        (
            MODEL + "criteria = StoppingCriteriaList([MaxTimeCriteria(30)])\ndef reply(ids):\n"
            "    return model.generate(ids, stopping_criteria=criteria)\nfor x in xs:\n    reply(x)",
            "reply is called in the loop on line",
        ),
        # ... used by a method
        (
            MODEL + "criteria = StoppingCriteriaList([MaxTimeCriteria(30)])\nclass Bot:\n"
            "    def reply(self, ids):\n        return model.generate(ids, stopping_criteria=criteria)",
            "reply is a method",
        ),
        # an empty list that a MaxTimeCriteria is appended to, in __init__
        (
            MODEL + "class Bot:\n    def __init__(self):\n        self.criteria = StoppingCriteriaList()\n"
            "        self.criteria.append(MaxTimeCriteria(5))\n"
            "    def reply(self, ids):\n        return model.generate(ids, stopping_criteria=self.criteria)",
            "kept on the object",
        ),
        # ... at module level, with extend, used in a loop
        (
            MODEL + "criteria = StoppingCriteriaList()\ncriteria.extend([MaxTimeCriteria(5)])\n"
            "for p in prompts:\n    model.generate(p, stopping_criteria=criteria)",
            "outside the loop",
        ),
        # a class attribute
        (
            MODEL + "class Bot:\n    criteria = StoppingCriteriaList([MaxTimeCriteria(5)])\n"
            "    def reply(self, ids):\n        return model.generate(ids, stopping_criteria=self.criteria)",
            "kept on the object",
        ),
        # built in __init__, given through a dict of generation arguments for a streaming thread
        (
            MODEL + "from threading import Thread\nclass Bot:\n    def __init__(self):\n"
            "        self.criteria = StoppingCriteriaList([MaxTimeCriteria(5)])\n"
            "    def reply(self, ids, streamer):\n"
            "        kwargs = {'input_ids': ids, 'streamer': streamer, 'stopping_criteria': self.criteria}\n"
            "        Thread(target=model.generate, kwargs=kwargs).start()",
            "kept on the object",
        ),
    ],
)
def test_stc007_fires_on_a_criteria_built_once_at_module_level_or_in_init(source, why):
    assert [c for _, c in found(source)] == ["STC007"]
    (message,) = messages(source, "STC007")
    assert why in message and "build it per call" in message and "stopcock.timeout" in message


@pytest.mark.parametrize(
    "source",
    [
        MODEL + "for p in prompts:\n    criteria = StoppingCriteriaList([MaxTimeCriteria(30)])\n"
        "    model.generate(**enc(p), stopping_criteria=criteria)",
        MODEL + "criteria = StoppingCriteriaList([MaxTimeCriteria(30)])\n"
        "model.generate(ids, stopping_criteria=criteria)",
        MODEL + "criteria = StoppingCriteriaList([MaxTimeCriteria(30)])\ndef main():\n"
        "    model.generate(ids, stopping_criteria=criteria)\nmain()",
        MODEL + "criteria = StoppingCriteriaList([Custom()])\nfor p in prompts:\n"
        "    model.generate(p, stopping_criteria=criteria)",
        MODEL + "class Bot:\n    def reply(self, ids):\n"
        "        self.c = StoppingCriteriaList([MaxTimeCriteria(5)])\n"
        "        return model.generate(ids, stopping_criteria=self.c)",
        # a list grown with a fresh MaxTimeCriteria in the function that uses it
        MODEL + "def reply(ids):\n    criteria = StoppingCriteriaList()\n"
        "    criteria.append(MaxTimeCriteria(5))\n"
        "    return model.generate(ids, stopping_criteria=criteria)\n"
        "for x in xs:\n    reply(x)",
        # a module-level list grown with something else
        MODEL + "criteria = StoppingCriteriaList()\ncriteria.append(Custom())\n"
        "def reply(ids):\n    return model.generate(ids, stopping_criteria=criteria)",
        # a dict literal built per call
        MODEL + "def reply(ids):\n"
        "    kw = {'stopping_criteria': StoppingCriteriaList([MaxTimeCriteria(5)])}\n"
        "    return model.generate(ids, **kw)",
        # a module-level name rebuilt by the function that uses it
        MODEL + "criteria = None\ndef reply(ids):\n    global criteria\n"
        "    criteria = StoppingCriteriaList([MaxTimeCriteria(5)])\n"
        "    return model.generate(ids, stopping_criteria=criteria)",
        # a class attribute that holds something else
        MODEL + "class Bot:\n    criteria = StoppingCriteriaList([Custom()])\n"
        "    def reply(self, ids):\n        return model.generate(ids, stopping_criteria=self.criteria)",
    ],
)
def test_stc007_stays_quiet_on_a_fresh_criteria_per_call(source):
    assert found(source, "STC007") == []


# -- STC008 swallowed stop ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "handler", ["except:", "except BaseException:", "except (ValueError, BaseException) as e:"]
)
def test_stc008_fires_on_catch_all_around_a_run_in_a_loop(handler):
    source = (
        SD + f"for p in prompts:\n    try:\n        images.append(pipe(p).images[0])\n    {handler}\n"
        "        print('failed', p)"
    )
    assert [c for _, c in found(source)] == ["STC008"]


@pytest.mark.parametrize(
    "source",
    [
        SD + "for p in prompts:\n    try:\n        pipe(p)\n    except Exception:\n        pass",
        SD + "for p in prompts:\n    try:\n        pipe(p)\n    except:\n        log()\n        raise",
        SD + "for p in prompts:\n    try:\n        pipe(p)\n    except BaseException:\n        break",
        SD + "try:\n    pipe(p)\nexcept:\n    pass",  # not in a loop
        "for p in prompts:\n    try:\n        requests.get(p)\n    except:\n        pass",  # no model run
    ],
)
def test_stc008_stays_quiet(source):
    assert found(source, "STC008") == []


# -- every rule --------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.code)
def test_each_rule_documents_itself_and_its_wrong_example_fires_while_the_right_one_does_not(rule):
    docs = rule.docs()
    assert rule.code in docs and "Wrong:" in docs and "Right:" in docs and rule.upstream
    imports = textwrap.dedent(
        """
        import stopcock
        from threading import Thread
        from diffusers import StableDiffusionPipeline, LatentConsistencyModelPipeline
        from transformers import (AutoModelForCausalLM, AutoTokenizer, MaxTimeCriteria, StoppingCriteria,
                                  StoppingCriteriaList, TextIteratorStreamer)
        model = AutoModelForCausalLM.from_pretrained("m")
        tokenizer = AutoTokenizer.from_pretrained("m")
        inputs = tokenizer(["x"], return_tensors="pt")
        """
    )
    wrong = [f.code for f in check_source(imports + textwrap.dedent(rule.wrong))]
    right = [f.code for f in check_source(imports + textwrap.dedent(rule.right))]
    assert rule.code in wrong
    assert rule.code not in right
