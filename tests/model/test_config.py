import copy
import json
import logging

import pytest
from paths import REPO

from inkling_jax.config import FULL, SLIDING, ConfigError, load_config, parse_config
from inkling_jax.param_count import count_parameters

FULL_CONFIG = json.loads((REPO / "configs" / "inkling2_small.json").read_text())


def test_full_config_parses_to_the_released_model():
    config = load_config(REPO / "configs" / "inkling2_small.json")
    text = config.text
    assert config.model_type == "inkling2" and config.image_token_id == 200054
    assert (text.hidden_size, text.num_hidden_layers, text.n_routed_experts) == (4608, 48, 384)
    assert text.layer_types.count(FULL) == 8 and text.layer_types.count(SLIDING) == 40
    assert [i for i, kind in enumerate(text.layer_types) if kind == FULL] == list(range(5, 48, 6))
    assert config.vision.intermediate_size == 4096


def test_defaults_are_transformers_defaults():
    bare = parse_config({"model_type": "inkling2", "text_config": {}, "vision_config": {}})
    full = load_config(REPO / "configs" / "inkling2_small.json")
    assert bare.text == full.text
    assert bare.vision == full.vision
    text_only = parse_config({"model_type": "inkling2_text"})
    assert text_only.text == full.text and text_only.vision is None


def test_aliases_map_to_fields():
    aliases = {
        "sliding_window": ("sliding_window_size", 96),
        "num_local_experts": ("n_routed_experts", 48),
        "sconv_kernel_size": ("conv_kernel_size", 3),
        "model_max_length": ("max_position_embeddings", 8192),
        "intermediate_size": ("moe_intermediate_size", 640),
        "routed_scaling_factor": ("route_scale", 2.5),
    }
    config = parse_config({"model_type": "inkling2_text", **{alias: value for alias, (_, value) in aliases.items()}})
    for field, value in aliases.values():
        assert getattr(config.text, field) == value
    vision = parse_config(
        {"model_type": "inkling2", "vision_config": {"native_patch_size": 14, "adapter_merge_size": 3}}
    ).vision
    assert (vision.patch_size, vision.spatial_merge_size) == (14, 3)


def test_unused_fields_are_accepted_and_logged(caplog):
    raw = copy.deepcopy(FULL_CONFIG)
    raw["text_config"]["some_training_knob"] = 3
    raw["torch_dtype"] = "bfloat16"
    with caplog.at_level(logging.DEBUG, logger="inkling_jax.config"):
        parse_config(raw)
    assert "text_config.some_training_knob" in caplog.text
    assert "torch_dtype" not in caplog.text


def _text(**fields):
    return {"model_type": "inkling2_text", **fields}


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ({"text_config": {}}, "model_type"),
        ({"model_type": "llama"}, "model_type"),
        (_text(hidden_size="4608"), "hidden_size"),
        (_text(hidden_size=True), "hidden_size"),
        (_text(log_scaling_alpha="x"), "log_scaling_alpha"),
        (_text(num_attention_heads=48, num_key_value_heads=7), "num_key_value_heads"),
        (_text(swa_num_attention_heads=6, swa_num_key_value_heads=4), "swa_num_key_value_heads"),
        (_text(num_hidden_layers=4, layer_types=["hybrid"] * 3), "layer_types"),
        (_text(num_hidden_layers=2, layer_types=["hybrid", "sliding"]), "layer_types[1]"),
        (_text(layer_types="hybrid"), "layer_types"),
        (_text(layer_types=[]), "layer_types has 0 entries"),
        (_text(unpadded_vocab_size=300000), "unpadded_vocab_size"),
        (_text(num_experts_per_tok=400), "num_experts_per_tok"),
        (_text(scoring_func="softmax"), "scoring_func"),
        (_text(hidden_size=0), "hidden_size"),
        (_text(eos_token_id=250000), "eos_token_id"),
        (_text(sliding_window=8, sliding_window_size=16), "'sliding_window.*contradicts"),
        (_text(log_scaling_alpha=float("nan")), "log_scaling_alpha' must be a finite number"),
        (_text(rms_norm_eps=float("inf")), "rms_norm_eps' must be a finite number"),
        ({"model_type": "inkling2", "vision_config": {"mlp_ratio": -4.0}}, "vision_config.mlp_ratio"),
        ({"model_type": "inkling2", "text_config": {"hidden_size": 64}}, "text_hidden_size"),
        ({"model_type": "inkling2", "text_config": []}, "text_config"),
        ({"model_type": "inkling2", "vision_config": {"num_attention_heads": 5}}, "num_attention_heads"),
    ],
)
def test_bad_configs_name_the_field(raw, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        parse_config(raw)


def test_alias_and_field_may_agree():
    assert parse_config(_text(sliding_window=64, sliding_window_size=64)).text.sliding_window_size == 64


def test_null_layer_types_take_the_default_pattern():
    assert (
        parse_config(_text(layer_types=None)).text.layer_types
        == load_config(REPO / "configs" / "inkling2_small.json").text.layer_types
    )


def test_unreadable_config_files(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match="no config file"):
        load_config(tmp_path)


def test_full_model_parameter_counts():
    """Counts from jax.eval_shape of our model equal the architecture's arithmetic, written out here."""
    counts = count_parameters(load_config(REPO / "configs" / "inkling2_small.json"))
    hidden, vocab, layers, experts, inner, top_k = 4608, 201024, 48, 384, 2304, 8
    heads, kv_heads, head_dim, d_rel, kernel, extent = 48, 8, 128, 16, 4, 1024
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * (2 * q + 2 * kv + heads * d_rel + heads) + q * hidden  # q, gate, k, v, r, sink, o
    attention += d_rel * extent + heads * head_dim + heads * d_rel  # rel profiles, q/rel clip scales
    sliding_extra = 2 * kv * kernel + hidden  # static k/v taps, input norm
    full_extra = 2 * (kernel * kv + hidden * kv_heads * kernel) + 3 * hidden  # dynamic taps, q/k/v norms
    mixing = 2 * hidden * kernel + hidden  # post-attention / post-MLP convs, post-attention norm
    router = experts * hidden + experts
    routed = 3 * hidden * inner * experts
    queries = hidden * (48 + 39 + 3 * 8)  # mlp_input everywhere; attention_input from layer 1 on
    per_layer = attention + mixing + router + routed
    text = layers * per_layer + 40 * sliding_extra + 8 * full_extra + queries
    text += 2 * vocab * hidden + 2 * hidden + hidden  # embed, unembed, embed/final norms, final query
    assert counts.text == text
    assert counts.routed_experts == layers * routed
    assert counts.active_per_token == text - layers * routed + layers * 3 * hidden * inner * top_k
    assert counts.vision == 327_693_312
    # The model card: 594B total, ~17-19B active.
    assert round(counts.total / 1e9, 2) == 594.05
    assert round(counts.active_per_token / 1e9, 2) == 18.89
    assert round(counts.active_per_token_without_embedding / 1e9, 2) == 17.96
