"""Small model configs several test files build models from."""

import json
from pathlib import Path

# Eight query heads of both kinds (tp8 fits), two KV heads (split at tp2, one copy per device beyond), 16 experts
# (2 per device at tp8); quantized experts (NVFP4 and MXFP8 layers) when written with experts="mixed".
WIDE_HEADS = {
    "model_type": "inkling2_text", "vocab_size": 512, "unpadded_vocab_size": 500, "hidden_size": 64,
    "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8,
    "swa_num_attention_heads": 8, "swa_num_key_value_heads": 2, "swa_head_dim": 8, "sliding_window_size": 8,
    "d_rel": 4, "rel_extent": 12, "log_scaling_n_floor": 10, "conv_kernel_size": 4, "moe_intermediate_size": 32,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "route_scale": 2.5, "eos_token_id": 499,
}  # fmt: skip

# three layers, one of them full attention, two per attention-residual block: the DSpark draft's target
TINY = {
    "model_type": "inkling2_text", "vocab_size": 64, "unpadded_vocab_size": 60, "hidden_size": 16,
    "num_hidden_layers": 3, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "swa_num_attention_heads": 2,
    "swa_num_key_value_heads": 2, "swa_head_dim": 4, "sliding_window_size": 4, "d_rel": 2, "rel_extent": 5,
    "moe_intermediate_size": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_layers_per_attn_res_block": 2,
    "eos_token_id": 3,
}  # fmt: skip


# four layers in blocks of two (sliding, full): every kind of layer and block at a config's widths, in a step program
# that compiles in a third of twelve layers' time (for tests of what runs the model, not of its depth)
FOUR_LAYERS = {
    "num_hidden_layers": 4,
    "n_layers_per_attn_res_block": 2,
    "layer_types": ["hybrid_sliding", "hybrid"] * 2,
}


def four_layers(config_path: Path, out: Path) -> Path:
    """The text config at `config_path` in FOUR_LAYERS, written to `out`. A draft reads layers 1 and 3."""
    config = json.loads(config_path.read_text()) | FOUR_LAYERS
    if "dspark_config" in config:
        config["dspark_config"]["target_layer_ids"] = [1, 3]
    out.write_text(json.dumps(config))
    return out


def without_tokenizer(checkpoint: Path) -> Path:
    """A synthetic checkpoint with its tokenizer and chat template removed: token ids in and out, as the parity
    fixtures serve them (no "text" in a result)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (checkpoint / name).unlink()
    return checkpoint
