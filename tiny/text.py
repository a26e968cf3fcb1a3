"""A tiny GPT-2 with a byte-level BPE tokenizer trained in memory (random weights)."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Stop the pipeline when the user presses the button.",
    "Hello world! Generation ends at a stop string, a timeout or a deadline.",
    "Once upon a time there was a small model that generated text token by token.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { } - _",
    "Unicode: café, naïve, Zürich, 東京, 😀 emoji.",
]
SPECIAL = ["<|endoftext|>", "<|pad|>"]


def build_tokenizer(vocab_size: int = 400):  # type: ignore[no-untyped-def]
    """A byte-level BPE tokenizer (``PreTrainedTokenizerFast``), padding on the left."""
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
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|pad|>",
        padding_side="left",
    )


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
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPT2LMHeadModel(config).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
