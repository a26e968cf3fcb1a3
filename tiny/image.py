"""Tiny real diffusers pipelines with random weights, built offline from configs.

``build_image_model(folder)`` saves a tiny Stable Diffusion pipeline that
``DiffusionPipeline.from_pretrained(folder)`` loads offline (64x64 images, ~10 ms a step on CPU).
The ``*_pipeline()`` builders return other pipeline kinds in memory, for tests and benchmarks;
each covers one of the stop paths of :mod:`stopcock.adapters.diffusers`. Dimensions follow the
dummy components of diffusers' own test suite; tokenizers are built in memory. No model here has
dropout, so train/eval mode makes no difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "SD_BETAS",
    "build_image_model",
    "clip_tokenizer",
    "t5_tokenizer",
    "stable_diffusion_pipeline",
    "safety_checker",
    "sdxl_pipeline",
    "flux_pipeline",
    "lcm_pipeline",
    "instruct_pix2pix_pipeline",
    "semantic_pipeline",
    "ddpm_pipeline",
    "modular_sdxl_pipeline",
    "kandinsky_combined_pipeline",
    "kandinsky3_pipeline",
    "wan_pipeline",
    "skyreels_df_pipeline",
    "text_to_video_pipeline",
    "audioldm_pipeline",
    "score_sde_pipeline",
    "modular_flux_pipeline",
    "stable_cascade_combined_pipeline",
]

# Stable Diffusion's noise schedule, shared by the schedulers of the SD-family builders.
SD_BETAS: dict[str, Any] = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


def clip_tokenizer(model_max_length: int = 77) -> Any:
    """A CLIP tokenizer over the 256 byte-level symbols (no merges): every prompt tokenizes."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    symbols = sorted(ByteLevel.alphabet())
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for s in symbols:
            vocab[s + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=model_max_length)


def clip_text_encoder(*, projection: bool = False, hidden_size: int = 32, seed: int = 0) -> Any:
    """A 2-layer CLIP text encoder (``CLIPTextModelWithProjection`` when ``projection``)."""
    import torch
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        hidden_size=hidden_size,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        projection_dim=32,
        vocab_size=514,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        hidden_act="gelu",
    )
    torch.manual_seed(seed)
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    return cls(config).eval()


def vae(*, seed: int = 0, **overrides: Any) -> Any:
    """A 2-level ``AutoencoderKL`` (scale factor 2) with 4 latent channels."""
    import torch
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    config: dict[str, Any] = dict(
        block_out_channels=[4, 8],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
        up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
        latent_channels=4,
        norm_num_groups=2,
        sample_size=64,
    )
    return AutoencoderKL(**{**config, **overrides})


def sd_unet(*, seed: int = 0, **overrides: Any) -> Any:
    """A 2-level ``UNet2DConditionModel`` on 32x32 latents with cross-attention to 32-dim text."""
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    config: dict[str, Any] = dict(
        block_out_channels=(4, 8),
        layers_per_block=1,
        sample_size=32,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        norm_num_groups=2,
    )
    return UNet2DConditionModel(**{**config, **overrides})


def _quiet(pipe: Any) -> Any:
    pipe.set_progress_bar_config(disable=True)
    return pipe


def t5_tokenizer() -> Any:
    """A T5 (Unigram) tokenizer over single characters, built in memory."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(33, 127)]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def t5_encoder(*, seed: int = 0) -> Any:
    """A 2-layer ``T5EncoderModel`` with 32-dim hidden states."""
    import torch
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(vocab_size=100, d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4)
    return T5EncoderModel(config).eval()


def _ddim() -> Any:
    from diffusers import DDIMScheduler

    return DDIMScheduler(**SD_BETAS, clip_sample=False, set_alpha_to_one=False, steps_offset=1)


def safety_checker(*, seed: int = 0) -> tuple[Any, Any]:
    """A tiny ``StableDiffusionSafetyChecker`` (1-layer CLIP vision, 32x32 crops), its feature extractor."""
    import torch
    from diffusers.pipelines.stable_diffusion.safety_checker import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor

    layer = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=1)
    config = CLIPConfig(
        text_config=layer, vision_config={**layer, "image_size": 32, "patch_size": 16}, projection_dim=32
    )
    torch.manual_seed(seed)
    return StableDiffusionSafetyChecker(config).eval(), CLIPImageProcessor(crop_size=32, size=32)


def _sd_family(
    cls_name: str, *, scheduler: Any = None, seed: int = 0, with_safety_checker: bool = False, **unet: Any
) -> Any:
    """A pipeline built from Stable Diffusion's components (vae, CLIP, UNet, a safety checker if asked)."""
    import diffusers

    checker, feature_extractor = safety_checker(seed=seed) if with_safety_checker else (None, None)
    return _quiet(
        getattr(diffusers, cls_name)(
            vae=vae(seed=seed),
            text_encoder=clip_text_encoder(seed=seed),
            tokenizer=clip_tokenizer(),
            unet=sd_unet(seed=seed, **unet),
            scheduler=scheduler or _ddim(),
            safety_checker=checker,
            feature_extractor=feature_extractor,
            requires_safety_checker=with_safety_checker,
        )
    )


def stable_diffusion_pipeline(
    *, scheduler: Any = None, seed: int = 0, with_safety_checker: bool = False
) -> Any:
    """A tiny ``StableDiffusionPipeline`` (category A); DDIM unless ``scheduler`` is given."""
    return _sd_family(
        "StableDiffusionPipeline", scheduler=scheduler, seed=seed, with_safety_checker=with_safety_checker
    )


def lcm_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``LatentConsistencyModelPipeline`` (category B: takes the callback, ignores interrupt)."""
    from diffusers import LCMScheduler

    return _sd_family(
        "LatentConsistencyModelPipeline", scheduler=LCMScheduler(**SD_BETAS), seed=seed, time_cond_proj_dim=32
    )


def instruct_pix2pix_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``StableDiffusionInstructPix2PixPipeline`` (category B); needs ``image=``."""
    return _sd_family("StableDiffusionInstructPix2PixPipeline", seed=seed, in_channels=8)


def semantic_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``SemanticStableDiffusionPipeline`` (category D: legacy ``callback`` only)."""
    return _sd_family("SemanticStableDiffusionPipeline", seed=seed)


def build_image_model(folder: str | Path, *, seed: int = 0) -> Path:
    """Save a tiny random-weight Stable Diffusion pipeline to ``folder``; returns the folder.

    ``DiffusionPipeline.from_pretrained(folder)`` loads it offline; it makes 64x64 images.
    """
    folder = Path(folder)
    stable_diffusion_pipeline(seed=seed).save_pretrained(folder)
    return folder


def sdxl_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``StableDiffusionXLPipeline`` (category A, two text encoders, text-time embedding)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    unet = sd_unet(
        seed=seed,
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=80,  # 6 * 8 + 32
        cross_attention_dim=64,
    )
    scheduler = EulerDiscreteScheduler(**SD_BETAS, timestep_spacing="leading", steps_offset=1)
    return _quiet(
        StableDiffusionXLPipeline(
            vae=vae(seed=seed),
            text_encoder=clip_text_encoder(seed=seed),
            text_encoder_2=clip_text_encoder(projection=True, seed=seed + 1),
            tokenizer=clip_tokenizer(),
            tokenizer_2=clip_tokenizer(),
            unet=unet,
            scheduler=scheduler,
        )
    )


def ddpm_pipeline(*, seed: int = 0) -> Any:
    """A tiny unconditional ``DDPMPipeline`` (category E: no step hook at all)."""
    import torch
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    torch.manual_seed(seed)
    unet = UNet2DModel(
        block_out_channels=(4, 8),
        layers_per_block=1,
        norm_num_groups=2,
        sample_size=16,
        in_channels=3,
        out_channels=3,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    return _quiet(DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=1000)))


def flux_pipeline(*, seed: int = 0, **transformer_config: Any) -> Any:
    """A tiny ``FluxPipeline`` (category A, transformer denoiser, flow matching); use height=width=32.

    ``transformer_config`` overrides the transformer's (e.g. ``num_layers=4, num_single_layers=8``).
    """
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(seed)
    config: dict[str, Any] = dict(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
    transformer = FluxTransformer2DModel(**{**config, **transformer_config})
    torch.manual_seed(seed)
    autoencoder = AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=1,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    return _quiet(
        FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(),
            vae=autoencoder,
            text_encoder=clip_text_encoder(seed=seed),
            tokenizer=clip_tokenizer(),
            text_encoder_2=t5_encoder(seed=seed),
            tokenizer_2=t5_tokenizer(),
            transformer=transformer,
        )
    )


def modular_sdxl_pipeline(*, seed: int = 0) -> Any:
    """A tiny modular SDXL pipeline (``StableDiffusionXLAutoBlocks``) with the SDXL components."""
    from diffusers.modular_pipelines import StableDiffusionXLAutoBlocks

    return _modular(StableDiffusionXLAutoBlocks(), sdxl_pipeline(seed=seed))


def _modular(blocks: Any, classic: Any) -> Any:
    """A modular pipeline of ``blocks`` holding the components of the ``classic`` pipeline."""
    pipe = blocks.init_pipeline()
    pipe.update_components(**{k: v for k, v in classic.components.items() if v is not None})
    return _quiet(pipe)


def kandinsky_combined_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``KandinskyV22CombinedPipeline``: a prior stage, then a decoder stage (64x64 images)."""
    import torch
    from diffusers import (
        DDPMScheduler,
        KandinskyV22CombinedPipeline,
        PriorTransformer,
        UnCLIPScheduler,
        UNet2DConditionModel,
    )
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    prior: Any = PriorTransformer(
        num_attention_heads=2, attention_head_dim=12, embedding_dim=32, num_layers=1
    )
    prior.clip_std = torch.nn.Parameter(torch.ones(prior.clip_std.shape))
    image_encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=32, image_size=32, projection_dim=32, intermediate_size=37, num_attention_heads=4,
            num_channels=3, num_hidden_layers=2, patch_size=16,
        )
    )
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        in_channels=4,
        out_channels=8,  # mean and variance
        addition_embed_type="image",
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn",
        block_out_channels=(8, 16),
        layers_per_block=1,
        encoder_hid_dim=32,
        encoder_hid_dim_type="image_proj",
        cross_attention_dim=32,
        attention_head_dim=4,
        norm_num_groups=4,
        resnet_time_scale_shift="scale_shift",
        class_embed_type=None,
    )
    return _quiet(
        KandinskyV22CombinedPipeline(
            unet=unet,
            scheduler=DDPMScheduler(
                beta_schedule="linear", beta_start=0.00085, beta_end=0.012, clip_sample=False, steps_offset=1,
            ),
            movq=_movq(seed=seed),
            prior_prior=prior,
            prior_image_encoder=image_encoder.eval(),
            prior_text_encoder=clip_text_encoder(projection=True, seed=seed),
            prior_tokenizer=clip_tokenizer(),
            prior_scheduler=UnCLIPScheduler(
                variance_type="fixed_small_log", prediction_type="sample", clip_sample=True,
                clip_sample_range=10.0,
            ),
            prior_image_processor=CLIPImageProcessor(crop_size=32, size=32),
        )
    )


def kandinsky3_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``Kandinsky3Pipeline`` (category B: takes the callback, never checks interrupt); 16x16."""
    import torch
    from diffusers import DDPMScheduler, Kandinsky3Pipeline, Kandinsky3UNet

    torch.manual_seed(seed)
    unet = Kandinsky3UNet(
        in_channels=4,
        time_embedding_dim=4,
        groups=2,
        attention_head_dim=4,
        layers_per_block=3,
        block_out_channels=(32, 64),
        cross_attention_dim=4,
        encoder_hid_dim=32,
    )
    scheduler = DDPMScheduler(
        beta_start=0.00085, beta_end=0.012, steps_offset=1, beta_schedule="squaredcos_cap_v2",
        clip_sample=True, thresholding=False,
    )
    return _quiet(
        Kandinsky3Pipeline(
            unet=unet, scheduler=scheduler, movq=_movq(seed=seed, block_out_channels=[32, 64]),
            text_encoder=t5_encoder(seed=seed), tokenizer=t5_tokenizer(),
        )
    )


def _movq(*, seed: int = 0, block_out_channels: list[int] | None = None) -> Any:
    """Kandinsky's 2-level ``VQModel`` (MoVQ) decoder, 4 latent channels."""
    import torch
    from diffusers import VQModel

    torch.manual_seed(seed)
    return VQModel(
        block_out_channels=block_out_channels or [32, 32],
        down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
        in_channels=3,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        norm_type="spatial",
        num_vq_embeddings=12,
        out_channels=3,
        up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"],
        vq_embed_dim=4,
    )


def _wan_vae(*, seed: int = 0) -> Any:
    """A tiny ``AutoencoderKLWan`` (16 latent channels; 9 frames become 3 latent frames)."""
    import torch
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )


def _wan_transformer(cls_name: str, *, seed: int = 0) -> Any:
    import diffusers
    import torch

    torch.manual_seed(seed)
    return getattr(diffusers, cls_name)(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    )


def wan_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``WanPipeline`` (text to video, category A); use height=width=16, num_frames=9."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    return _quiet(
        WanPipeline(
            transformer=_wan_transformer("WanTransformer3DModel", seed=seed), vae=_wan_vae(seed=seed),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), text_encoder=t5_encoder(seed=seed),
            tokenizer=t5_tokenizer(),
        )
    )


def skyreels_df_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``SkyReelsV2DiffusionForcingPipeline`` (video; steps one scheduler copy per latent frame);
    use height=width=16, num_frames=9."""
    from diffusers import SkyReelsV2DiffusionForcingPipeline, UniPCMultistepScheduler

    return _quiet(
        SkyReelsV2DiffusionForcingPipeline(
            transformer=_wan_transformer("SkyReelsV2Transformer3DModel", seed=seed), vae=_wan_vae(seed=seed),
            scheduler=UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True),
            text_encoder=t5_encoder(seed=seed), tokenizer=t5_tokenizer(),
        )
    )


def text_to_video_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``TextToVideoSDPipeline`` (video, category D: legacy ``callback`` only); 32x32 frames."""
    import torch
    from diffusers import TextToVideoSDPipeline, UNet3DConditionModel

    torch.manual_seed(seed)
    unet = UNet3DConditionModel(
        block_out_channels=(8, 8), layers_per_block=1, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), cross_attention_dim=32, attention_head_dim=4,
        norm_num_groups=2,
    )
    autoencoder = vae(seed=seed, block_out_channels=(8,), down_block_types=["DownEncoderBlock2D"],
                      up_block_types=["UpDecoderBlock2D"], sample_size=32)
    return _quiet(
        TextToVideoSDPipeline(
            vae=autoencoder, text_encoder=clip_text_encoder(seed=seed), tokenizer=clip_tokenizer(), unet=unet,
            scheduler=_ddim(),
        )
    )


def audioldm_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``AudioLDMPipeline`` (text to audio, category D: legacy ``callback`` only); use
    ``audio_length_in_s=0.1`` or so: its vocoder turns 8-bin mel frames into a 16 kHz waveform."""
    import torch
    from diffusers import AudioLDMPipeline, UNet2DConditionModel
    from transformers import (
        ClapTextConfig,
        ClapTextModelWithProjection,
        SpeechT5HifiGan,
        SpeechT5HifiGanConfig,
    )

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=8, sample_size=32, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=(8, 16),
        class_embed_type="simple_projection", projection_class_embeddings_input_dim=8,
        class_embeddings_concat=True,
    )
    autoencoder = vae(seed=seed, block_out_channels=[8, 16], in_channels=1, out_channels=1, norm_num_groups=8)
    torch.manual_seed(seed)
    text_encoder = ClapTextModelWithProjection(
        ClapTextConfig(
            bos_token_id=0, eos_token_id=2, hidden_size=8, intermediate_size=37, layer_norm_eps=1e-05,
            num_attention_heads=1, num_hidden_layers=1, pad_token_id=1, vocab_size=1000, projection_dim=8,
        )
    ).eval()
    torch.manual_seed(seed)
    vocoder = SpeechT5HifiGan(
        SpeechT5HifiGanConfig(
            model_in_dim=8, sampling_rate=16000, upsample_initial_channel=16, upsample_rates=[2, 2],
            upsample_kernel_sizes=[4, 4], resblock_kernel_sizes=[3, 7],
            resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]], normalize_before=False,
        )
    ).eval()
    return _quiet(
        AudioLDMPipeline(
            vae=autoencoder, text_encoder=text_encoder, tokenizer=clip_tokenizer(), unet=unet,
            scheduler=_ddim(), vocoder=vocoder,
        )
    )


def score_sde_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``ScoreSdeVePipeline`` (category E; its loop steps no scheduler: predictor-corrector
    methods instead of ``step``); 16x16 images."""
    from diffusers import ScoreSdeVePipeline, ScoreSdeVeScheduler

    return _quiet(ScoreSdeVePipeline(unet=ddpm_pipeline(seed=seed).unet, scheduler=ScoreSdeVeScheduler()))


def modular_flux_pipeline(*, seed: int = 0) -> Any:
    """A tiny modular Flux pipeline (``FluxAutoBlocks``) with the Flux components; use height=width=32."""
    from diffusers.modular_pipelines import FluxAutoBlocks

    return _modular(FluxAutoBlocks(), flux_pipeline(seed=seed))


def stable_cascade_combined_pipeline(*, seed: int = 0) -> Any:
    """A tiny ``StableCascadeCombinedPipeline``: a prior stage, then a decoder stage, stepping one
    shared ``DDPMWuerstchenScheduler`` (as in diffusers' own test); use height=width=128."""
    import torch
    from diffusers import DDPMWuerstchenScheduler, StableCascadeCombinedPipeline
    from diffusers.models import StableCascadeUNet
    from diffusers.pipelines.deprecated.wuerstchen import PaellaVQModel

    torch.manual_seed(seed)
    prior = StableCascadeUNet(
        conditioning_dim=128, block_out_channels=(128, 128), num_attention_heads=(2, 2),
        down_num_layers_per_block=(1, 1), up_num_layers_per_block=(1, 1), clip_image_in_channels=768,
        switch_level=(False,), clip_text_in_channels=32, clip_text_pooled_in_channels=32,
    ).eval()
    torch.manual_seed(seed)
    decoder = StableCascadeUNet(
        in_channels=4, out_channels=4, conditioning_dim=128, block_out_channels=(16, 32, 64, 128),
        num_attention_heads=(-1, -1, 1, 2), down_num_layers_per_block=(1, 1, 1, 1),
        up_num_layers_per_block=(1, 1, 1, 1), down_blocks_repeat_mappers=(1, 1, 1, 1),
        up_blocks_repeat_mappers=(3, 3, 2, 2),
        block_types_per_layer=(
            ("SDCascadeResBlock", "SDCascadeTimestepBlock"),
            ("SDCascadeResBlock", "SDCascadeTimestepBlock"),
            ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),
            ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),
        ),
        switch_level=None, clip_text_pooled_in_channels=32, dropout=(0.1, 0.1, 0.1, 0.1),
    ).eval()
    torch.manual_seed(seed)
    vqgan = PaellaVQModel(bottleneck_blocks=1, num_vq_embeddings=2).eval()
    scheduler = DDPMWuerstchenScheduler()
    return _quiet(
        StableCascadeCombinedPipeline(
            text_encoder=clip_text_encoder(projection=True, seed=seed), tokenizer=clip_tokenizer(),
            decoder=decoder, scheduler=scheduler, vqgan=vqgan,
            prior_text_encoder=clip_text_encoder(projection=True, seed=seed),
            prior_tokenizer=clip_tokenizer(), prior_prior=prior, prior_scheduler=scheduler,
            prior_feature_extractor=None, prior_image_encoder=None,
        )
    )
