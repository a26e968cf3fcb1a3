"""Tiny text and speech models with random weights, built offline from configs.

``build_text_model(folder)`` saves a tiny GPT-2 with a byte-level BPE tokenizer trained in memory.
The ``*_pipeline()`` builders return, in memory, one pipeline for every transformers task that
generates (``GENERATING_TASKS``): image-text-to-text (LLaVA), any-to-any (Qwen2-Audio),
automatic-speech-recognition (Whisper), text-to-audio (MusicGen, and SpeechT5 with its own loop),
document-question-answering (Donut: a DonutSwin encoder and a GPT-2 decoder) and
table-question-answering (BART, with a tokenizer that flattens the table). Dimensions follow the
model testers of transformers' own test suite, shrunk; every model uses the tokenizer above (plus
the special tokens its processor needs), so nothing is downloaded. Random weights make random
tokens, and the builders suppress special tokens a random model would repeat, so each makes text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Stop the pipeline when the user presses the button.",
    "Hello world! Generation ends at a stop string, a timeout or a deadline.",
    "Once upon a time there was a small model that generated text token by token.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { } - _",
    "Unicode: café, naïve, Zürich, 東京, 😀 emoji.",
]
SPECIAL = ["<|endoftext|>", "<|pad|>"]


def build_tokenizer(vocab_size: int = 400, special: tuple[str, ...] = (), padding_side: str = "left"):  # type: ignore[no-untyped-def]
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``), padding on the left by default;
    ``special`` adds special tokens (a processor's image or audio token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|pad|>",
        padding_side=padding_side,
    )
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def build_text_model(
    folder: str | Path, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 2, seed: int = 0
) -> Path:
    """Save a tiny random-weight GPT-2 and its tokenizer to ``folder``; returns the folder.

    ``AutoModelForCausalLM``, ``AutoTokenizer`` and ``pipeline("text-generation", model=folder)``
    load it offline.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = Path(folder)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=1024,
        vocab_size=len(tokenizer),
        **_token_ids(tokenizer),
    )
    model = GPT2LMHeadModel(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


#: The transformers pipeline tasks that call ``generate``, each with its tiny builders below.
GENERATING_TASKS = (
    "text-generation",
    "image-text-to-text",
    "any-to-any",
    "automatic-speech-recognition",
    "text-to-audio",
    "document-question-answering",
    "table-question-answering",
)

SAMPLING_RATE = 16000


def _token_ids(tokenizer: Any) -> dict[str, Any]:
    """The special token ids a config takes from the tokenizer."""
    ids = ("pad_token_id", "bos_token_id", "eos_token_id")
    return {name: getattr(tokenizer, name) for name in ids}


def _small_decoder(config_class: Any, tokenizer: Any, positions: int) -> Any:
    """A 2-layer, 32-wide decoder config (Llama-style: LLaVA's, Qwen2-Audio's text model)."""
    return config_class(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        **_token_ids(tokenizer),
    )


def _seeded(seed: int) -> None:
    import torch

    torch.manual_seed(seed)


def text_generation_pipeline(seed: int = 0) -> Any:
    """``text-generation`` over a tiny GPT-2 (the model ``build_text_model`` saves), in memory."""
    from transformers import GPT2Config, GPT2LMHeadModel, pipeline

    tokenizer = build_tokenizer()
    _seeded(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=len(tokenizer),
        **_token_ids(tokenizer),
    )
    return pipeline("text-generation", model=GPT2LMHeadModel(config).eval(), tokenizer=tokenizer)


def sample_image(size: int = 16, seed: int = 0) -> Any:
    """A small RGB noise image (PIL)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).rand(size, size, 3) * 255
    return Image.fromarray(pixels.astype("uint8"))


def sample_audio(seconds: float = 0.5, seed: int = 0) -> Any:
    """Noise at ``SAMPLING_RATE``: a bare float32 array, as ASR pipelines take it."""
    import numpy as np

    return np.random.RandomState(seed).randn(int(SAMPLING_RATE * seconds)).astype(np.float32)


def _chat_template(media: str) -> str:
    """A chat template that writes ``media`` for each image/audio part and the text of the others."""
    return (
        "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] in ('image', 'audio') %}"
        + media
        + "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )


def llava_pipeline(seed: int = 0) -> Any:
    """``image-text-to-text``: a tiny LLaVA (CLIP vision tower, Llama text model), 16x16 images."""
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        pipeline,
    )

    tokenizer = build_tokenizer(special=("<image>",))
    _seeded(seed)
    vision = CLIPVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=16,
        patch_size=4,
        projection_dim=16,
    )
    text = _small_decoder(LlamaConfig, tokenizer, positions=256)
    config = LlavaConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=16,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    model = LlavaForConditionalGeneration(config).eval()
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
        ),
        tokenizer=tokenizer,
        patch_size=4,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=_chat_template("<image>"),
    )
    return pipeline("image-text-to-text", model=model, processor=processor)


def qwen2_audio_pipeline(seed: int = 0) -> Any:
    """``any-to-any``: a tiny Qwen2-Audio (audio in, text out; an image model would need torchvision)."""
    from transformers import (
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        Qwen2Config,
        WhisperFeatureExtractor,
        pipeline,
    )

    tokenizer = build_tokenizer(special=("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"))
    _seeded(seed)
    audio = Qwen2AudioEncoderConfig(
        num_mel_bins=80,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=32,
        d_model=16,
        max_source_positions=1500,
    )
    text = _small_decoder(Qwen2Config, tokenizer, positions=2048)
    config = Qwen2AudioConfig(
        audio_config=audio.to_dict(),
        text_config=text.to_dict(),
        audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"),
    )
    model = Qwen2AudioForConditionalGeneration(config).eval()
    processor = Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=80),
        tokenizer=tokenizer,
        chat_template=_chat_template("<|audio_bos|><|AUDIO|><|audio_eos|>"),
    )
    return pipeline("any-to-any", model=model, processor=processor)


def whisper_pipeline(seed: int = 0) -> Any:
    """``automatic-speech-recognition``: a tiny Whisper (its tokenizer over this BPE vocabulary)."""
    import json

    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizer,
        pipeline,
    )

    bpe = json.loads(build_tokenizer().backend_tokenizer.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in bpe["merges"]]
    tokenizer = WhisperTokenizer(vocab=bpe["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|startoftranscript|>", "<|notimestamps|>"]})
    start: int = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")  # type: ignore[assignment]
    eos = tokenizer.eos_token_id
    _seeded(seed)
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=80,
        encoder_layers=2,
        decoder_layers=2,
        d_model=32,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=1500,
        max_target_positions=64,
        pad_token_id=eos,
        bos_token_id=eos,
        eos_token_id=eos,
        decoder_start_token_id=start,
        # a random model repeats special tokens, which the transcription drops: keep them out
        suppress_tokens=[start, start + 1],
        begin_suppress_tokens=[eos],
    )
    model = WhisperForConditionalGeneration(config).eval()
    features = WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLING_RATE)
    return pipeline(
        "automatic-speech-recognition", model=model, tokenizer=tokenizer, feature_extractor=features
    )


def musicgen_pipeline(seed: int = 0) -> Any:
    """``text-to-audio``: a tiny MusicGen (T5 text encoder, EnCodec with 4 codebooks, 8 kHz)."""
    from transformers import (
        EncodecConfig,
        MusicgenConfig,
        MusicgenDecoderConfig,
        MusicgenForConditionalGeneration,
        T5Config,
        pipeline,
    )

    tokenizer = build_tokenizer()
    _seeded(seed)
    text = T5Config(
        vocab_size=len(tokenizer),
        d_model=16,
        d_ff=16,
        num_layers=2,
        num_heads=2,
        d_kv=8,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # 8 kHz, 4x upsampling: 2000 frames a second, each of 4 codebooks (64 entries)
    audio = EncodecConfig(
        hidden_size=16,
        compress=1,
        num_filters=4,
        codebook_size=64,
        codebook_dim=16,
        num_lstm_layers=1,
        upsampling_ratios=[2, 2],
        sampling_rate=8000,
        target_bandwidths=[64.0],
    )
    decoder = MusicgenDecoderConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_dim=16,
        pad_token_id=64,
        bos_token_id=64,
        num_codebooks=4,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    decoder.decoder_start_token_id = 64  # the pad code starts every codebook
    config = MusicgenConfig(
        text_encoder=text.to_dict(), audio_encoder=audio.to_dict(), decoder=decoder.to_dict()
    )
    model = MusicgenForConditionalGeneration(config).eval()
    return pipeline("text-to-audio", model=model, tokenizer=tokenizer)


def speecht5_pipeline(seed: int = 0) -> tuple[Any, Any]:
    """``text-to-audio`` with SpeechT5, whose ``generate`` is its own loop (no stopping criteria),
    ended by a stop-probability head; returns the pipeline and a speaker embedding to pass as
    ``forward_params={"speaker_embeddings": ...}``. The head is biased so that the random model
    never stops on its own: it runs to its length limit (20 frames per input token)."""
    import torch
    from transformers import (
        SpeechT5Config,
        SpeechT5ForTextToSpeech,
        SpeechT5HifiGan,
        SpeechT5HifiGanConfig,
        pipeline,
    )

    tokenizer = build_tokenizer()
    _seeded(seed)
    config = SpeechT5Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        num_mel_bins=8,
        speech_decoder_prenet_units=16,
        speech_decoder_postnet_units=16,
        speech_decoder_postnet_layers=1,
        speaker_embedding_dim=8,
        reduction_factor=2,
        max_speech_positions=512,
        max_text_positions=64,
        **_token_ids(tokenizer),
    )
    model = SpeechT5ForTextToSpeech(config).eval()
    with torch.no_grad():
        model.speech_decoder_postnet.prob_out.bias.fill_(-1e4)
    vocoder = SpeechT5HifiGan(
        SpeechT5HifiGanConfig(
            model_in_dim=8,
            upsample_initial_channel=8,
            upsample_rates=[2],
            upsample_kernel_sizes=[4],
            resblock_kernel_sizes=[3],
            resblock_dilation_sizes=[[1]],
            sampling_rate=SAMPLING_RATE,
        )
    ).eval()
    pipe = pipeline("text-to-audio", model=model, tokenizer=tokenizer, vocoder=vocoder)
    return pipe, torch.zeros(1, 8)


def donut_pipeline(seed: int = 0, max_new_tokens: int = 24) -> Any:
    """``document-question-answering``: a tiny Donut (DonutSwin encoder, GPT-2 decoder), 32x32 pages.

    The pipeline drops generation arguments given at call time (``max_new_tokens`` included), so
    the length limit is the model's generation config: ``max_new_tokens``.
    """
    from transformers import (
        DonutImageProcessorPil,
        DonutSwinConfig,
        GPT2Config,
        VisionEncoderDecoderConfig,
        VisionEncoderDecoderModel,
        pipeline,
    )

    tags = ("<s_docvqa>", "<s_question>", "</s_question>", "<s_answer>", "</s_answer>")
    tokenizer = build_tokenizer(special=tags, padding_side="right")
    _seeded(seed)
    encoder = DonutSwinConfig(
        image_size=[32, 32], patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[2, 2], window_size=2
    )
    decoder = GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=len(tokenizer),
        add_cross_attention=True,
        **_token_ids(tokenizer),
    )
    decoder.is_decoder = True
    config = VisionEncoderDecoderConfig(encoder=encoder.to_dict(), decoder=decoder.to_dict())
    model = VisionEncoderDecoderModel(config=config).eval()
    generation = model.generation_config
    generation.decoder_start_token_id = generation.bos_token_id = tokenizer.bos_token_id
    generation.pad_token_id, generation.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    generation.max_new_tokens = max_new_tokens
    generation.suppress_tokens = tokenizer.convert_tokens_to_ids(list(tags))
    images = DonutImageProcessorPil(
        size={"height": 32, "width": 32}, do_align_long_axis=False, do_thumbnail=False, do_pad=False
    )
    return pipeline("document-question-answering", model=model, tokenizer=tokenizer, image_processor=images)


def table_tokenizer() -> Any:
    """The tokenizer above, also taking ``(table, query)`` as generative table-QA models read them:
    the table flattened row by row (``col | col ; value | value ...``), then the question."""
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer(padding_side="right")

    class TableTokenizer(PreTrainedTokenizerFast):
        def __call__(self, table: Any = None, query: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
            if hasattr(table, "columns"):
                rows = [" | ".join(map(str, table.columns))]
                rows += [" | ".join(map(str, row)) for row in table.itertuples(index=False)]
                flat = " ; ".join(rows)
                queries = [query] if isinstance(query, str) else list(query)
                kwargs.pop("truncation", None)  # "do_not_truncate", a TAPAS strategy
                return super().__call__([f"{flat} question: {q}" for q in queries], **kwargs)
            return super().__call__(table, query, **kwargs)

    return TableTokenizer(
        tokenizer_object=base.backend_tokenizer,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        unk_token=base.unk_token,
        pad_token=base.pad_token,
        padding_side="right",
    )


def table_qa_pipeline(seed: int = 0, max_new_tokens: int = 24) -> Any:
    """``table-question-answering`` with a tiny BART (generative, like TAPEX); needs pandas.

    The pipeline drops generation arguments given at call time (``max_new_tokens`` included), so
    the length limit is the model's generation config: ``max_new_tokens``.
    """
    from transformers import BartConfig, BartForConditionalGeneration, pipeline

    tokenizer = table_tokenizer()
    _seeded(seed)
    config = BartConfig(
        vocab_size=len(tokenizer),
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=16,
        decoder_ffn_dim=16,
        max_position_embeddings=256,
        **_token_ids(tokenizer),
        decoder_start_token_id=tokenizer.bos_token_id,
        forced_eos_token_id=None,
    )
    model = BartForConditionalGeneration(config).eval()
    model.generation_config.max_new_tokens = max_new_tokens
    model.generation_config.suppress_tokens = [tokenizer.eos_token_id]
    return pipeline("table-question-answering", model=model, tokenizer=tokenizer)


def sample_table() -> Any:
    """A small pandas table for table-question-answering."""
    import pandas as pd

    return pd.DataFrame({"city": ["Paris", "Lyon", "Nice"], "people": ["2100000", "520000", "340000"]})


@dataclass
class TaskCase:
    """A generating task's tiny pipeline, one input and its call arguments, several inputs, and how
    to read what it made (``content(output)``: the text, answer or audio samples)."""

    task: str
    pipe: Any
    item: Any
    kwargs: dict[str, Any]
    content: Callable[[Any], Any]
    items: list[Any] = field(default_factory=list)
    stepping: Any = None  # the module that runs once per token (default: the pipeline's model)

    @property
    def stepper(self) -> Any:
        return self.stepping if self.stepping is not None else self.pipe.model


#: Tokens a full run makes, where the call sets the length (document- and table-QA: the model's 24).
CASE_TOKENS = 12


def _chat(kind: str, media: Any, text: str = "what is it") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": kind, kind: media}, {"type": "text", "text": text}]}]


def _reply(out: Any) -> Any:
    return out[0]["generated_text"][-1]["content"]


def task_case(task: str) -> TaskCase:
    """The case of ``task``: one of ``TASK_CASES`` (the generating tasks, and SpeechT5's loop)."""
    new = CASE_TOKENS
    if task == "text-generation":
        return TaskCase(
            task,
            text_generation_pipeline(),
            "Hello world",
            {"max_new_tokens": new, "do_sample": False},
            lambda out: out[0]["generated_text"],
            ["Hello world", "The quick brown fox", "Stop it"],
        )
    if task == "image-text-to-text":
        image = sample_image()
        return TaskCase(
            task,
            llava_pipeline(),
            _chat("image", image),
            {"max_new_tokens": new},
            _reply,
            [_chat("image", image, q) for q in ("what", "who", "where")],
        )
    if task == "any-to-any":
        return TaskCase(
            task,
            qwen2_audio_pipeline(),
            _chat("audio", sample_audio()),
            {"max_new_tokens": new},
            _reply,
            [_chat("audio", sample_audio(seed=s)) for s in range(3)],
        )
    if task == "automatic-speech-recognition":
        return TaskCase(
            task,
            whisper_pipeline(),
            sample_audio(),
            {"max_new_tokens": new},
            lambda out: out["text"],
            [sample_audio(seed=s) for s in range(3)],
        )
    if task == "text-to-audio":
        return TaskCase(
            task,
            musicgen_pipeline(),
            "a calm tune",
            {"generate_kwargs": {"max_new_tokens": new, "do_sample": False}},
            lambda out: out["audio"],
            ["a calm tune", "a fast beat", "rain"],
        )
    if task == "text-to-audio (SpeechT5)":
        pipe, speaker = speecht5_pipeline()
        return TaskCase(
            task,
            pipe,
            "hello world",
            {"forward_params": {"speaker_embeddings": speaker}},
            lambda out: out["audio"],
            ["hello world", "good night", "stop"],
            stepping=pipe.model.speecht5.decoder.wrapped_decoder,
        )
    if task == "document-question-answering":
        page = sample_image(32)
        return TaskCase(
            task,
            donut_pipeline(),
            {"image": page, "question": "what"},
            {},
            lambda out: out[0]["answer"],
            [{"image": page, "question": q} for q in ("what", "who", "when")],
        )
    if task == "table-question-answering":
        table = sample_table()
        return TaskCase(
            task,
            table_qa_pipeline(),
            {"table": table, "query": "how many people"},
            {},
            lambda out: out["answer"],
            [{"table": table, "query": q} for q in ("how many", "which city", "largest")],
        )
    raise ValueError(f"no tiny case for {task!r}; known: {TASK_CASES}")


#: The cases: each generating task, and text-to-audio's second kind of loop.
TASK_CASES = (*GENERATING_TASKS, "text-to-audio (SpeechT5)")


def sliding_window_model(*, window: int = 4, seed: int = 0) -> Any:
    """A tiny random-weight Mistral whose attention sees the last ``window`` tokens: its cache is made
    of sliding-window layers (``DynamicSlidingWindowLayer``). Token ids as :func:`build_tokenizer`'s."""
    from transformers import MistralConfig, MistralForCausalLM

    config = _small_decoder(MistralConfig, build_tokenizer(), positions=256)
    config.sliding_window = window
    _seeded(seed)
    return MistralForCausalLM(config).eval()
