"""Tiny random Hugging Face checkpoints, generated in the test with transformers (the
oracle; a dev dependency only): one per architecture and RoPE / window variant.

Weights are drawn with a larger spread than transformers' default (``initializer_range``
0.02 gives nearly uniform attention, under which a key missing from a window barely
changes the output); 0.15 makes attention peaked enough that a window off by one token
moves logits far beyond the 1e-4 tolerance.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

VOCAB = 300
WINDOW = 12
CAP = 8.0  # Gemma 3's final_logit_softcapping in its variant
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)

NEMOTRON_H = dict(head_dim=24, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
                  n_groups=2, conv_kernel=4, chunk_size=16, time_step_min=1e-6,
                  time_step_floor=1e-2)

# name: (config class, its fields beyond COMMON)
VARIANTS = {
    "llama": (transformers.LlamaConfig, dict(num_hidden_layers=2)),
    "llama-rope-llama3": (transformers.LlamaConfig, dict(
        num_hidden_layers=2, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=32))),
    "llama-rope-linear": (transformers.LlamaConfig, dict(
        num_hidden_layers=2, rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                  factor=4.0))),
    "qwen2": (transformers.Qwen2Config, dict(num_hidden_layers=2, tie_word_embeddings=True)),
    # Qwen2's own sliding rule: layers from max_window_layers on slide.
    "qwen2-sliding": (transformers.Qwen2Config, dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
        max_window_layers=1)),
    "qwen3": (transformers.Qwen3Config, dict(
        num_hidden_layers=4, head_dim=24, use_sliding_window=True, sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"])),
    "mistral": (transformers.MistralConfig, dict(num_hidden_layers=2, sliding_window=WINDOW)),
    # LFM2: short-convolution layers (a conv state only) around one attention layer
    "lfm2": (transformers.Lfm2Config, dict(
        num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3,
        block_multiple_of=32, tie_word_embeddings=True)),
    # Gemma 3: local (sliding) and global layers, each kind with its own RoPE (the global
    # one linearly scaled), an attention scale of its own (24 ** -0.5, head_dim 16) and
    # softcapped final logits.
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"],
        rope_parameters=dict(
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
            full_attention=dict(rope_type="linear", rope_theta=1000000.0, factor=8.0)),
        final_logit_softcapping=CAP)),
    # Sliding and full layers alternating (GptOssConfig's default layer_types), attention
    # sinks, 4 experts of which 2 per token, YaRN from 32 positions (8x, so positions past
    # 32 are scaled); transformers' eager attention (the one with sinks) as the oracle.
    "gpt-oss": (transformers.GptOssConfig, dict(
        num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
        num_experts_per_tok=2, attn_implementation="eager",
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0,
                             beta_fast=32.0, beta_slow=1.0, truncate=False,
                             original_max_position_embeddings=32))),
    # The real 3:1 ratio of Gated DeltaNet to gated attention layers; MoE layers (4 experts,
    # top-2, a shared expert) but layer 1, dense (mlp_only_layers); RoPE on half of each head.
    "qwen3-next": (transformers.Qwen3NextConfig, dict(
        num_hidden_layers=4, head_dim=16, partial_rotary_factor=0.5,
        layer_types=["linear_attention", "linear_attention", "linear_attention",
                     "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        mlp_only_layers=[1])),
    # Mamba-2, attention (no RoPE), MLP; chunk_size 16 puts scan-chunk boundaries inside our
    # prompts. time_step_min is tiny (dt_bias drawn at least softplus^-1(time_step_floor)),
    # so the clamp at time_step_min, which transformers' one-token decode step leaves out
    # (nemotron_h.py), never changes a value and generate stays a valid oracle.
    "nemotron-h": (transformers.NemotronHConfig, dict(NEMOTRON_H,
                                                      hybrid_override_pattern="M*M-")),
    # ... and an MoE layer: 8 experts in 2 groups (1 chosen), 2 per token, a latent projection.
    "nemotron-h-moe": (transformers.NemotronHConfig, dict(
        NEMOTRON_H, hybrid_override_pattern="ME*M", n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=32,
        n_group=2, topk_group=1, routed_scaling_factor=2.5)),
    # Kimi Linear: three KDA layers (short convolutions + gated delta rule, states only),
    # then one NoPE MLA layer caching its latents (as the checkpoints list them, 1-based);
    # a dense MLP in layer 0, MoE after (4 experts, top 2, one shared). MLA expands a key
    # and value per head, so K/V heads = heads.
    "kimi-linear": (transformers.KimiLinearConfig, dict(
        num_hidden_layers=4, num_key_value_heads=4, moe_intermediate_size=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4,
                                kda_layers=[1, 2, 3], full_attn_layers=[4]),
        num_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)),
}

# The attention-only variants' pools: (kind, window, layers in the pool), in the engine's
# pool order (tests/replicas/models/test_hf_models.py runs these).
FULL2 = [("full", None, 2)]
POOLS = {
    "llama": FULL2, "llama-rope-llama3": FULL2, "llama-rope-linear": FULL2, "qwen2": FULL2,
    "qwen2-sliding": [("full", None, 1), ("sliding", WINDOW, 2)],
    "qwen3": [("full", None, 2), ("sliding", WINDOW, 2)],
    "mistral": [("sliding", WINDOW, 2)],
    "gemma3": [("full", None, 1), ("sliding", WINDOW, 3)],
    "gpt-oss": [("full", None, 2), ("sliding", WINDOW, 2)],
}


# The variants tests/replicas/models/test_families.py serves through the scheduler.
FAMILY_VARIANTS = [
    "llama",
    "qwen3",
    "gemma3",
    "lfm2",
    "gpt-oss",
    "qwen3-next",
    "nemotron-h",
    "nemotron-h-moe",
    "kimi-linear",
]


def hf_config(variant: str, **changes) -> transformers.PretrainedConfig:
    cls, fields = VARIANTS[variant]
    return cls(**{**COMMON, **fields, **changes})


def save_checkpoint(variant: str, directory: Path, seed: int = 0, changes: dict | None = None,
                    **save_kwargs):
    """Save a random ``variant`` (its config with ``changes``) to ``directory``
    (safetensors); returns the model."""
    torch.manual_seed(seed)
    config = hf_config(variant, **(changes or {}))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    return model


def hybrid_config_dir(directory: Path) -> Path:
    """A config-only checkpoint (no weights, no tokenizer) of a tiny Qwen3-Next: 3
    recurrent layers and 1 attention layer, for sim replicas of a hybrid model."""
    transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128,
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, max_position_embeddings=4096,
        architectures=["Qwen3NextForCausalLM"]).save_pretrained(directory)
    return directory
