"""How the committed demo text model was made: ``python -m stopcock.tiny.train FOLDER``.

A 2-layer GPT-2 (byte-level BPE) trained for a minute on CPU on the Zen of Python, which every
Python ships (the ``this`` module), so the demo's text is recognisable instead of gibberish. The
text is repeated in a loop, so the model never emits end-of-text: generation runs on until a stop.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import sys
from pathlib import Path


def zen() -> str:
    """The Zen of Python (``import this`` prints it; the module holds it ROT13-encoded)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def train_text_model(folder: str | Path, *, steps: int = 600, seed: int = 0) -> Path:
    """Train the demo text model and save it (weights in float32) with its tokenizer to ``folder``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    text = zen().strip() + "\n\n"
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [text],
        trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left",
    )
    ids = torch.tensor(tokenizer(text * 40)["input_ids"])
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=1024, vocab_size=len(tokenizer),
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    window, batch = 128, 16
    for step in range(steps):
        starts = torch.randint(0, len(ids) - window, (batch,))
        x = torch.stack([ids[s : s + window] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.3f}", file=sys.stderr)
    model.eval().generation_config.pad_token_id = tokenizer.pad_token_id
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    train_text_model(sys.argv[1])

