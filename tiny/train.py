"""How the committed demo models were made: ``python -m tiny.train text|image FOLDER``.

Both are trained briefly on CPU on data that ships with Python or a PyPI package, so the demo's
output is recognisable instead of noise:

- text: a 2-layer GPT-2 (byte-level BPE) trained on the Zen of Python (the ``this`` module). The
  text is repeated in a loop, so the model never emits end-of-text: generation runs until a stop.
- image: a tiny Stable Diffusion pipeline that draws scikit-learn's 8x8 handwritten digits for the
  prompts "0" to "9". Its UNet is trained on 8x8 latents that are the digit images themselves; its
  VAE is not trained but built by hand so that the decoder turns such latents into the 16x16
  picture (identity convolutions, zeroed residual branches, a nearest-neighbour upsampling and a
  fixed colour map); its CLIP text encoder keeps its random weights (the UNet learns to read them).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import sys
from pathlib import Path
from typing import Any


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


def digit_vae(channels: int = 16, latent_channels: int = 4) -> Any:
    """An ``AutoencoderKL`` whose decoder maps digit-image latents (8x8, in [-1, 1], the same in every
    channel) to a 16x16 picture: light strokes on a dark ground. Its encoder is unused (zeros)."""
    import torch
    from diffusers import AutoencoderKL

    vae: Any = AutoencoderKL(
        block_out_channels=[channels, channels], in_channels=3, out_channels=3, layers_per_block=1,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=latent_channels, norm_num_groups=4, sample_size=16, scaling_factor=1.0,
    )
    vae.eval()

    def identity(conv: torch.nn.Conv2d, inputs: int) -> None:
        row, column = conv.kernel_size[0] // 2, conv.kernel_size[1] // 2
        for out in range(conv.out_channels):
            conv.weight[out, out % inputs, row, column] = 1.0

    with torch.no_grad():
        for p in vae.parameters():  # residual branches and attention outputs at zero: identities
            p.zero_()
        for m in vae.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.fill_(1.0)
        decoder = vae.decoder
        identity(vae.post_quant_conv, latent_channels)
        identity(decoder.conv_in, latent_channels)
        for block in decoder.up_blocks:
            for upsampler in block.upsamplers or ():
                identity(upsampler.conv, channels)
        for rgb, weight in enumerate((1.4, 1.05, 0.42)):  # warm strokes
            decoder.conv_out.weight[rgb, :, 1, 1] = weight / channels
            decoder.conv_out.bias[rgb] = -0.8
    return vae


def train_image_model(folder: str | Path, *, steps: int = 3000, seed: int = 0) -> Path:
    """Train the demo image pipeline and save it to ``folder``."""
    import torch
    from diffusers import DDIMScheduler, DDPMScheduler, StableDiffusionPipeline
    from sklearn.datasets import load_digits

    from .image import SD_BETAS, clip_text_encoder, clip_tokenizer, sd_unet

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32)[:, None].repeat(1, 4, 1, 1) / 8 - 1
    labels = torch.tensor(data.target)
    tokenizer, text_encoder = clip_tokenizer(), clip_text_encoder(seed=seed)
    prompts = [str(d) for d in range(10)] + [""]  # "" is the unconditional prompt of guidance
    with torch.no_grad():
        ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                        truncation=True, return_tensors="pt").input_ids
        embeddings = text_encoder(ids)[0]
    noise_schedule: Any = DDPMScheduler(num_train_timesteps=1000, **SD_BETAS)
    unet = sd_unet(seed=seed, block_out_channels=(16, 32), sample_size=8, norm_num_groups=8).train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=2e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    generator = torch.Generator().manual_seed(seed)
    batch = 64
    for step in range(steps):
        pick = torch.randint(0, len(images), (batch,), generator=generator)
        x0, y = images[pick], labels[pick].clone()
        y[torch.rand(batch, generator=generator) < 0.1] = 10
        noise = torch.randn(x0.shape, generator=generator)
        t = torch.randint(0, 1000, (batch,), generator=generator)
        noisy = noise_schedule.add_noise(x0, noise, t)
        loss = torch.nn.functional.mse_loss(unet(noisy, t, encoder_hidden_states=embeddings[y]).sample, noise)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step} loss {loss.item():.4f}", file=sys.stderr, flush=True)
    pipe: Any = StableDiffusionPipeline(
        vae=digit_vae(), text_encoder=text_encoder, tokenizer=tokenizer, unet=unet.eval(),
        scheduler=DDIMScheduler(clip_sample=False, set_alpha_to_one=False, steps_offset=1,
                                timestep_spacing="trailing", **SD_BETAS),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.save_pretrained(folder)
    return Path(folder)


if __name__ == "__main__":
    {"text": train_text_model, "image": train_image_model}[sys.argv[1]](sys.argv[2])

