"""Write the model shapes the hybrid-cluster benchmarks serve with ``--engine sim --model``:
a ``config.json`` each (no weights, no tokenizer: byte-level), from transformers' config
classes with the published models' layer layouts, windows and cache shapes. Experts and
hidden sizes are kept small where they change nothing the sim reads (pools, windows,
recurrent state shapes, context length), so a sim replica starts in seconds.

    .venv/bin/python -m bench.shapes.make_shapes       # rewrites bench/shapes/*/config.json
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def shapes() -> dict:
    import transformers

    return {
        # Qwen3-Next-80B-A3B: 48 layers, 3 Gated DeltaNet : 1 gated attention
        # (full_attention_interval 4), 2 KV heads of 256, DeltaNet 16 key / 32 value heads of
        # 128, conv kernel 4; 262,144 positions
        "qwen3-next": transformers.Qwen3NextConfig(
            vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, full_attention_interval=4,
            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
            linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            intermediate_size=128, max_position_embeddings=262144,
            architectures=["Qwen3NextForCausalLM"], dtype="bfloat16"),
        # Gemma 3 12B: 48 layers, 5 local (window 1024) : 1 global, 8 KV heads of 256
        "gemma3": transformers.Gemma3TextConfig(
            vocab_size=262208, hidden_size=256, intermediate_size=256, num_hidden_layers=48,
            num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
            query_pre_attn_scalar=256, max_position_embeddings=131072,
            architectures=["Gemma3ForCausalLM"], dtype="bfloat16"),
        # GPT-OSS 20B: 24 layers alternating sliding (128) and full, 8 KV heads of 64, sinks
        "gpt-oss": transformers.GptOssConfig(
            vocab_size=201088, hidden_size=256, intermediate_size=256, num_hidden_layers=24,
            num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
            num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=131072,
            architectures=["GptOssForCausalLM"], dtype="bfloat16"),
    }


def main() -> int:
    for name, config in shapes().items():
        (HERE / name).mkdir(exist_ok=True)
        config.save_pretrained(HERE / name)
        print(f"wrote bench/shapes/{name}/config.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
