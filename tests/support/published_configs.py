"""The published config.json of the targets the plan is sized for, the fields that size them (no weights).

The pipeline's fit check and the train stage's torch-free parameter counts are tested on these; both read only
config.json, as the pre-submit check does.
"""

from __future__ import annotations

from typing import Any

# Qwen/Qwen3.6-27B's config.json, the fields that size it: 64 layers in the 3 Gated DeltaNet : 1 full attention
# pattern, hidden 5120, intermediate 17408, 24 query / 4 KV heads of 256, 16 key / 48 value linear heads of 128,
# a 4-tap conv, the untied 248,320-row vocabulary.
QWEN3_6_27B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "num_hidden_layers": 64, "hidden_size": 5120, "intermediate_size": 17408,
        "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 248320,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
        "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "attn_output_gate": True, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
    "vision_config": {"depth": 27, "hidden_size": 1152},
}
# Qwen/Qwen3-8B's: dense, 36 layers, hidden 4096, intermediate 12288, 32 query / 8 KV heads of 128.
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096,
    "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
    "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
}
# Qwen/Qwen3-30B-A3B's: 48 layers, each a mixture of 128 experts of width 768 (8 routed per token, no shared
# expert), hidden 2048, 32 query / 4 KV heads of 128, the untied Qwen3 vocabulary: 30.5B held, 3.3B active.
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_hidden_layers": 48,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# Qwen/Qwen2.5-7B-Instruct's: dense, 28 layers, hidden 3584, intermediate 18944, 28 query / 4 KV heads (head_dim
# 128, stated nowhere: hidden / heads), biased q/k/v, the untied 152,064-row vocabulary: 7.61B (the model card).
QWEN2_5_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584,
    "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 32768, "max_window_layers": 28, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "sliding_window": 131072, "use_sliding_window": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
