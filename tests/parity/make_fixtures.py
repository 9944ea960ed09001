"""Build the reference-side parity fixtures for the Inkling 2 JAX port.

This script runs against the *PyTorch reference* (transformers 5.23.0, torch 2.13.0 CPU) and must
never import ``inkling_jax``. For every tiny configuration it writes
``tests/fixtures/parity/<name>/``:

* ``hf/``           config.json (with ``transformers_version``) + weights under the transformers
                    module names (``Model.state_dict()``), written directly with safetensors.
* ``original/``     config.json (no ``transformers_version``, like a hub release) + one
                    ``model.safetensors`` in the original checkpoint layout (``model.llm.*``,
                    ``model.visual.*``), i.e. the inverse of transformers' conversion mapping.
                    The script proves the layout by loading it back through ``from_pretrained``.
* ``reference.npz`` input ids, float32 / bfloat16 logits and a greedy continuation.
* ``images.npz``    (multimodal configs) prompts with one and with two images: placeholder-expanded ids,
                    pixel values, grids, the image tower's features and the logits (float32 and bfloat16).
* ``images/``       those images as PNG files (``<case>_<i>.png``), and ``preprocessor_config.json`` (the
                    image processor's settings: the config's tile size) beside both layouts' config.json.
* ``meta.json``     versions, seeds, init scales and the activation statistics printed below.

The quantized fixtures (``QUANT_FIXTURES``: ``tiny_text_mxfp8``, ``tiny_text_mixed``) reuse
``tiny_text``'s weights with the routed experts stored as MXFP8 / NVFP4 (own numpy/torch codec,
cross-checked against ml_dtypes): ``original/`` only, ``reference.npz`` (input ids, float32 logits
and greedy ids of transformers run on the dequantized expert weights) and ``meta.json``.

Run it through ``tests/parity/regenerate.sh``; it is deterministic (fixed seeds).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import safetensors
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import (
    Inkling2Config,
    Inkling2ForCausalLM,
    Inkling2ForConditionalGeneration,
    Inkling2TextConfig,
)

PINNED_TRANSFORMERS = "5.23.0"
PINNED_TORCH = "2.13.0"

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "parity"

GREEDY_PROMPT_LEN = 9
GREEDY_NEW_TOKENS = 16

# Knobs shared by both tiny configs: small clip thresholds / softcaps so that every nonlinearity
# is active on random weights (see the statistics printed by the script).
ACTIVE_NONLINEARITIES = {
    "qk_l2_clip_threshold": 3.0,
    "rel_l2_clip_threshold": 1.0,
    "mlp_gate_softcap": 1.0,
    "mlp_up_softcap": 1.5,
    "final_logit_softcapping": 3.0,
}

TINY_TEXT_CONFIG = {
    "vocab_size": 512,
    "unpadded_vocab_size": 500,
    "hidden_size": 64,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "sliding_window_size": 8,
    "d_rel": 4,
    "rel_extent": 12,
    "log_scaling_n_floor": 10,
    "log_scaling_alpha": 0.5,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "route_scale": 2.5,
    "n_layers_per_attn_res_block": 6,
    "conv_kernel_size": 4,
    "eos_token_id": 499,
    "max_position_embeddings": 4096,
    **ACTIVE_NONLINEARITIES,
}

TINY_MM_TEXT_CONFIG = {
    "vocab_size": 384,
    "unpadded_vocab_size": 380,
    "hidden_size": 48,
    "num_hidden_layers": 7,
    "layer_types": [
        "hybrid",
        "hybrid_sliding",
        "hybrid_sliding",
        "hybrid",
        "hybrid_sliding",
        "hybrid_sliding",
        "hybrid",
    ],
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 12,
    "swa_num_attention_heads": 6,
    "swa_num_key_value_heads": 3,
    "swa_head_dim": 8,
    "sliding_window_size": 6,
    "d_rel": 3,
    "rel_extent": 10,
    "log_scaling_n_floor": 7,
    "log_scaling_alpha": 0.3,
    "moe_intermediate_size": 24,
    "n_routed_experts": 6,
    "num_experts_per_tok": 3,
    "route_scale": 1.7,
    "n_layers_per_attn_res_block": 3,
    "conv_kernel_size": 3,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 379,
    **ACTIVE_NONLINEARITIES,
}

TINY_MM_VISION_CONFIG = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 4,
    "spatial_merge_size": 2,
    "posemb_grid_size": 4,
    "projection_hidden_dim": 48,
    "text_hidden_size": 48,
}

# Standard deviations of the normal draws replacing the default (std 0.02) init of the text weights.
# q/k/r are tuned so that a sizeable fraction of head vectors hits the L2 clip; lm_head so that the
# pre-softcap logits are of the order of the final softcap; experts so that both MLP softcaps bite.
TINY_TEXT_STDS = {
    "q_proj": 0.085,
    "k_proj": 0.2,
    "r_proj": 0.07,
    "o_proj": 0.15,
    "gate_proj": 0.2,
    "sink_proj": 0.2,
    "weight_proj": 0.1,
    "router": 0.2,
    "experts": 0.3,
    "lm_head": 0.4,
}
TINY_MM_STDS = {
    "q_proj": 0.12,
    "k_proj": 0.2,
    "r_proj": 0.08,
    "o_proj": 0.17,
    "gate_proj": 0.2,
    "sink_proj": 0.2,
    "weight_proj": 0.1,
    "router": 0.25,
    "experts": 0.3,
    "lm_head": 0.45,
}

FIXTURES = {
    "tiny_text": {
        "kind": "text",
        "seed": 20240611,
        "seq_len": 40,
        "stds": TINY_TEXT_STDS,
        "sharded": False,
    },
    "tiny_mm": {
        "kind": "mm",
        "seed": 20240612,
        "seq_len": 37,
        "stds": TINY_MM_STDS,
        "sharded": True,
        "image_token_id": 300,
        # image cases: (height, width) of each image, text tokens before / between / after the images
        "image_cases": {
            "one": {"images": [(20, 28)], "text": [5, 6]},
            "two": {"images": [(20, 28), (7, 17)], "text": [4, 5, 4]},
        },
    },
}


# --------------------------------------------------------------------------------------------------
# Configs and models
# --------------------------------------------------------------------------------------------------


def build_config(spec: dict[str, Any]):
    if spec["kind"] == "text":
        config = Inkling2TextConfig(**TINY_TEXT_CONFIG)
        config.architectures = ["Inkling2ForCausalLM"]
    else:
        config = Inkling2Config(
            text_config=dict(TINY_MM_TEXT_CONFIG),
            vision_config=dict(TINY_MM_VISION_CONFIG),
            image_token_id=spec["image_token_id"],
        )
        config.architectures = ["Inkling2ForConditionalGeneration"]
    return config


def model_class(spec: dict[str, Any]):
    return Inkling2ForCausalLM if spec["kind"] == "text" else Inkling2ForConditionalGeneration


def text_config_of(model) -> Inkling2TextConfig:
    return model.config.get_text_config()


def _draw(gen: torch.Generator, shape, kind: str, a: float, b: float = 0.0) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(shape, generator=gen, dtype=torch.float32) * a
    return torch.rand(shape, generator=gen, dtype=torch.float32) * (b - a) + a


def _text_rule(name: str, owner_cls: str, stds: dict[str, float]):
    """Replacement distribution for one text-model tensor, or None to keep the default init."""
    if owner_cls == "Inkling2RMSNorm":
        return ("uniform", 0.5, 1.5)
    if name.endswith(("attention_input.query", "mlp_input.query", "final_input.query")):
        return ("normal", 1.0)
    if name.endswith("static_weight"):
        return ("normal", 0.3)
    if name.endswith("_l2_clip.scale"):
        return ("uniform", 0.5, 1.5)
    if name.endswith("e_score_correction_bias"):
        return ("normal", 0.5)
    if name.endswith("conv1d.weight"):
        return ("normal", 0.3)
    if name.endswith("rel_logits_proj.proj"):
        return ("normal", 1.0)
    if name.endswith("embed_tokens.weight"):
        return ("normal", 1.0)
    if name == "lm_head.weight":
        return ("normal", stds["lm_head"])
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return ("normal", stds["experts"])
    if name.endswith("mlp.gate.weight"):
        return ("normal", stds["router"])
    if name.endswith("weight_proj.weight"):
        return ("normal", stds["weight_proj"])
    m = re.search(r"self_attn\.(q_proj|k_proj|r_proj|o_proj|gate_proj|sink_proj)\.weight$", name)
    if m:
        return ("normal", stds[m.group(1)])
    return None


# Multipliers on the vision tower's default-initialised (std 0.02) weights, applied after the random draws (so the
# text weights and every draw stay as they were): sharp attention (RoPE and the per-image masks matter), position
# embeddings comparable to the patch embeddings, and image features of order one.
VISION_SCALES = {
    r"embeddings\.(patch_embedding\.weight|position_embedding\.weight)": 5.0,
    r"self_attn\.(q_proj|k_proj)\.weight": 10.0,
    r"self_attn\.(v_proj|out_proj)\.weight": 5.0,
    r"mlp\.(fc1|fc2)\.weight": 5.0,
    r"merger\.(linear_1|linear_2)\.weight": 10.0,
}


def scale_vision_(model, init_plan: dict[str, str]) -> None:
    """Multiply the tower's weights by VISION_SCALES, in place, noting it in the init plan."""
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if ".vision_tower." not in f".{name}":
                continue
            for pattern, factor in VISION_SCALES.items():
                if re.search(pattern, name):
                    tensor.mul_(factor)
                    key = re.sub(r"\.\d+\.", ".*.", name)
                    if not init_plan[key].endswith(f" x {factor}"):  # once per name pattern, not per layer
                        init_plan[key] = f"{init_plan[key]} x {factor}"


def _vision_rule(name: str, owner_cls: str):
    """Vision tower: make the default-constant tensors (norms, biases, layer scales) random."""
    if owner_cls == "LayerNorm":
        return ("uniform", 0.5, 1.5) if name.endswith("weight") else ("normal", 0.1)
    if name.endswith(".bias"):
        return ("normal", 0.05)
    if re.search(r"lambda_[12]$", name):
        return ("uniform", 0.05, 0.3)
    return None


def randomize_(model, seed: int, stds: dict[str, float]) -> dict[str, str]:
    """Overwrite (in place, deterministically) every tensor whose default init is trivial."""
    gen = torch.Generator().manual_seed(seed + 1)
    applied = {}
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            owner_cls = type(owner).__name__
            if ".vision_tower." in f".{name}":
                rule = _vision_rule(name, owner_cls)
            else:
                rule = _text_rule(name, owner_cls, stds)
            key = re.sub(r"\.\d+\.", ".*.", name)
            if rule is None:
                applied[key] = "default init (normal std 0.02)"
                continue
            tensor.copy_(_draw(gen, tensor.shape, *rule))
            applied[key] = f"{rule[0]}{tuple(rule[1:])}"
    return applied


def check_nontrivial(state_dict: dict[str, torch.Tensor]) -> None:
    """No constant tensor, and no two tensors of one shape equal (so a name swap cannot hide)."""
    by_shape: dict[tuple, list[str]] = {}
    for name, tensor in state_dict.items():
        if tensor.numel() > 1 and bool((tensor == tensor.flatten()[0]).all()):
            raise AssertionError(f"{name} is constant")
        by_shape.setdefault(tuple(tensor.shape), []).append(name)
    for names in by_shape.values():
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if torch.equal(state_dict[a], state_dict[b]):
                    raise AssertionError(f"{a} and {b} are identical")


# --------------------------------------------------------------------------------------------------
# Original checkpoint layout (inverse of conversion_mapping.py "inkling2" / "inkling2_text")
# --------------------------------------------------------------------------------------------------

# Per-layer names, relative to `layers.{i}.`: transformers name -> original name.
_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn.wq_du.weight",
    "self_attn.k_proj.weight": "attn.wk_dv.weight",
    "self_attn.v_proj.weight": "attn.wv_dv.weight",
    "self_attn.r_proj.weight": "attn.wr_du.weight",
    "self_attn.o_proj.weight": "attn.wo_ud.weight",
    "self_attn.gate_proj.weight": "attn.gate_attn.weight",
    "self_attn.sink_proj.weight": "attn.attn_sink_proj.weight",
    "self_attn.q_l2_clip.scale": "attn.q_l2_clip.scale",
    "self_attn.rel_l2_clip.scale": "attn.rel_l2_clip.scale",
    "self_attn.rel_logits_proj.proj": "attn.rel_logits_proj.proj",
    # static short convolutions (sliding layers)
    "self_attn.k_sconv.conv1d.weight": "attn.k_sconv.weight",
    "self_attn.v_sconv.conv1d.weight": "attn.v_sconv.weight",
    # dynamic short convolutions (full layers)
    "self_attn.k_sconv.static_weight": "attn.k_sconv.static_w",
    "self_attn.v_sconv.static_weight": "attn.v_sconv.static_w",
    "self_attn.k_sconv.weight_proj.weight": "attn.k_sconv.weight_proj",
    "self_attn.v_sconv.weight_proj.weight": "attn.v_sconv.weight_proj",
    "post_attention_convolution.conv1d.weight": "attn_sconv.weight",
    "post_mlp_convolution.conv1d.weight": "mlp_sconv.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "q_input_layernorm.weight": "q_input_norm.weight",
    "k_input_layernorm.weight": "k_input_norm.weight",
    "v_input_layernorm.weight": "v_input_norm.weight",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias": "mlp.gate.bias",
    "mlp.experts.gate_up_proj": "mlp.experts.w13_weight",  # rows interleaved, see below
    "mlp.experts.down_proj": "mlp.experts.w2_weight",
}

# Text-model names outside the layers, relative to the text model root.
_TEXT_ROOT_NAMES = {
    "embed_tokens.weight": "embed.weight",
    "embed_tokens.embed_norm.weight": "embed_norm.weight",
    "norm.weight": "norm.weight",
    "final_input.query": "attn_res.output_query",
}

# Vision tower, full names: regex on the transformers name -> original name template.
_VISION_NAMES = [
    (
        r"model\.vision_tower\.embeddings\.position_embedding\.weight",
        "model.visual.backbone.embeddings.position_embedding",
    ),
    (
        r"model\.vision_tower\.embeddings\.(patch_embedding\.weight|class_embedding|cls_position_embedding)",
        r"model.visual.backbone.embeddings.\1",
    ),
    (r"model\.vision_tower\.pre_layernorm\.(weight|bias)", r"model.visual.backbone.ln_pre.\1"),
    (
        r"model\.vision_tower\.layers\.(\d+)\.layernorm_before\.(weight|bias)",
        r"model.visual.backbone.layers.\1.ln_1.\2",
    ),
    (
        r"model\.vision_tower\.layers\.(\d+)\.layernorm_after\.(weight|bias)",
        r"model.visual.backbone.layers.\1.ln_2.\2",
    ),
    (
        r"model\.vision_tower\.layers\.(\d+)\.mlp\.fc1\.(weight|bias)",
        r"model.visual.backbone.layers.\1.mlp.c_fc.\2",
    ),
    (
        r"model\.vision_tower\.layers\.(\d+)\.mlp\.fc2\.(weight|bias)",
        r"model.visual.backbone.layers.\1.mlp.c_proj.\2",
    ),
    (r"model\.vision_tower\.layers\.(\d+)\.lambda_1", r"model.visual.backbone.layers.\1.ls_1.gamma"),
    (r"model\.vision_tower\.layers\.(\d+)\.lambda_2", r"model.visual.backbone.layers.\1.ls_2.gamma"),
    (
        r"model\.vision_tower\.layers\.(\d+)\.self_attn\.((?:q|k|v|out)_proj\.(?:weight|bias))",
        r"model.visual.backbone.layers.\1.self_attn.\2",
    ),
    (r"model\.vision_tower\.merger\.linear_1\.(weight|bias)", r"model.visual.proj_in.\1"),
    (r"model\.vision_tower\.merger\.linear_2\.(weight|bias)", r"model.visual.proj_out.\1"),
]


def _original_text_name(rel: str) -> str:
    """Transformers text-model name (relative to the text model root) -> name under `model.llm.`."""
    if rel in _TEXT_ROOT_NAMES:
        return _TEXT_ROOT_NAMES[rel]
    m = re.fullmatch(r"layers\.(\d+)\.attention_input\.query", rel)
    if m:  # the original list starts at layer 1 (layer 0 has no attention-input residual)
        return f"attn_res.attn_queries.{int(m.group(1)) - 1}"
    m = re.fullmatch(r"layers\.(\d+)\.mlp_input\.query", rel)
    if m:
        return f"attn_res.mlp_queries.{m.group(1)}"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", rel)
    if m and m.group(2) in _LAYER_NAMES:
        return f"layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise KeyError(f"no original name for text tensor {rel!r}")


def original_name(name: str, kind: str) -> str:
    if name == "lm_head.weight":
        return "model.llm.unembed.weight"
    text_root = "model." if kind == "text" else "model.language_model."
    if name.startswith(text_root):
        return "model.llm." + _original_text_name(name[len(text_root) :])
    for pattern, template in _VISION_NAMES:
        m = re.fullmatch(pattern, name)
        if m:
            return m.expand(template)
    raise KeyError(f"no original name for {name!r}")


def interleave_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] with gate rows then up rows -> rows alternating gate_j, up_j (original w13)."""
    num_experts, two_i, hidden = gate_up.shape
    halves = gate_up.reshape(num_experts, 2, two_i // 2, hidden)
    return halves.transpose(1, 2).reshape(num_experts, two_i, hidden).contiguous()


def to_original_state_dict(state_dict: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state_dict.items():
        new_name = original_name(name, kind)
        if new_name in out:
            raise AssertionError(f"two tensors map to {new_name}")
        if name.endswith("mlp.experts.gate_up_proj"):
            tensor = interleave_gate_up(tensor)
        out[new_name] = tensor.detach().clone().contiguous()
    return out


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def _drop_version(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _drop_version(v) for k, v in d.items() if k != "transformers_version"}
    return d


def _contiguous(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def write_hf(model, out_dir: Path, sharded: bool) -> list[str]:
    out_dir.mkdir(parents=True)
    model.config.to_json_file(str(out_dir / "config.json"))
    sd = _contiguous(model.state_dict())
    if not sharded:
        save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = list(sd)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    running = 0
    for name in names:  # module order; the split falls in the middle of the language model
        size = sd[name].numel() * sd[name].element_size()
        shards[0 if running + size <= total // 2 else 1][name] = sd[name]
        running += size
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for shard, fname in zip(shards, files, strict=True):
        assert shard, "empty shard"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [*files, "model.safetensors.index.json"]


def write_original(model, kind: str, out_dir: Path) -> dict[str, torch.Tensor]:
    out_dir.mkdir(parents=True)
    config_dict = _drop_version(json.loads(model.config.to_json_string(use_diff=True)))
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    orig = to_original_state_dict(model.state_dict(), kind)
    save_file(orig, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return orig


# --------------------------------------------------------------------------------------------------
# Proofs
# --------------------------------------------------------------------------------------------------


def _assert_clean_loading_info(info: dict[str, Any], where: str) -> None:
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise AssertionError(f"loading {where} reported problems: {problems}")


def _assert_same_state(reference: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], where: str) -> None:
    if set(reference) != set(loaded):
        raise AssertionError(
            f"{where}: key sets differ: only in source {sorted(set(reference) - set(loaded))[:8]}, "
            f"only in loaded {sorted(set(loaded) - set(reference))[:8]}"
        )
    for name, tensor in reference.items():
        other = loaded[name]
        if other.dtype != tensor.dtype or other.shape != tensor.shape or not torch.equal(other, tensor):
            raise AssertionError(f"{where}: tensor {name} differs after loading")


def original_config_for_loading(kind: str, original_dir: Path):
    """The config object for loading `original/`.

    For the multimodal model, `Inkling2Config.from_dict` injects the MXFP8 quantization config
    whenever the dict has neither `quantization_config` nor `transformers_version` (exactly the case
    of an original hub config.json). These fixture weights are plain float32, so the proof builds the
    config from the same file with the version key added, which skips only that injection.
    """
    raw = json.loads((original_dir / "config.json").read_text())
    if kind == "text":
        return Inkling2TextConfig.from_dict(raw)
    return Inkling2Config.from_dict({**raw, "transformers_version": transformers.__version__})


def prove_loading(
    spec, model, hf_dir: Path, original_dir: Path, input_ids: np.ndarray, logits_f32: np.ndarray
) -> dict[str, Any]:
    cls = model_class(spec)
    kind = spec["kind"]
    reference = model.state_dict()
    facts: dict[str, Any] = {}

    # original layout -> transformers
    config = original_config_for_loading(kind, original_dir)
    expected_cfg = _drop_version(json.loads(model.config.to_json_string(use_diff=True)))
    got_cfg = _drop_version(json.loads(config.to_json_string(use_diff=True)))
    if expected_cfg != got_cfg:
        raise AssertionError("original/config.json does not round-trip to the source config")
    loaded, info = cls.from_pretrained(str(original_dir), config=config, output_loading_info=True, dtype=torch.float32)
    _assert_clean_loading_info(info, "original/")
    _assert_same_state(reference, loaded.state_dict(), "original/")
    facts["original_loading_info"] = {k: sorted(v) if isinstance(v, (set, list)) else v for k, v in info.items()}

    if kind == "mm":
        # Document the quirk: the plain config path would turn this into an fp8 (MXFP8) checkpoint.
        injected = Inkling2Config.from_pretrained(str(original_dir)).quantization_config
        injected = injected.to_dict() if hasattr(injected, "to_dict") else injected
        assert injected and injected.get("quant_method") == "fp8", injected
        facts["original_config_plain_load_quantization_config"] = injected

    # transformers layout (sharded for tiny_mm) -> transformers
    loaded_hf, info_hf = cls.from_pretrained(str(hf_dir), output_loading_info=True, dtype=torch.float32)
    _assert_clean_loading_info(info_hf, "hf/")
    _assert_same_state(reference, loaded_hf.state_dict(), "hf/")

    # Same weights, other memory placement: CPU kernels may round differently (see README).
    facts["f32_reload_logit_diff"] = {
        src: float(np.abs(causal_logits(m.eval(), input_ids) - logits_f32).max())
        for src, m in (("original", loaded), ("hf", loaded_hf))
    }
    return facts


# --------------------------------------------------------------------------------------------------
# Statistics (how strongly each nonlinearity acts on the fixture input)
# --------------------------------------------------------------------------------------------------


class StatsCollector:
    def __init__(self, model):
        self.model = model
        self.tcfg = text_config_of(model)
        self.handles = []
        self.records: dict[str, list] = {}

    def _add(self, key, value):
        self.records.setdefault(key, []).append(value)

    def __enter__(self):
        for name, module in self.model.named_modules():
            cls = type(module).__name__
            layer = re.search(r"layers\.(\d+)\.", name + ".")
            layer = int(layer.group(1)) if layer else -1
            if ".vision_tower" in f".{name}":
                continue
            if cls == "Inkling2ScaledL2Clip":
                tag = "q" if name.endswith("q_l2_clip") else "rel"
                self.handles.append(module.register_forward_pre_hook(self._scaled_clip_hook(tag, layer)))
            elif cls == "Inkling2L2Clip":
                self.handles.append(module.register_forward_pre_hook(self._clip_hook("k", layer)))
            elif cls == "Inkling2SoftcappedSwiGLU":
                self.handles.append(module.register_forward_pre_hook(self._swiglu_hook))
            elif cls == "Inkling2TopKRouter":
                self.handles.append(module.register_forward_pre_hook(self._router_hook))
            elif cls == "Inkling2BlockAttentionResidual":
                self.handles.append(module.register_forward_pre_hook(self._block_attn_hook))
        self.handles.append(self.model.logit_softcap.register_forward_pre_hook(self._final_hook))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _scaled_clip_hook(self, tag, layer):
        def hook(module, args):
            x = args[0].float() * module.scale.float()
            frac = (torch.linalg.vector_norm(x, dim=-1) > module.threshold).float().mean().item()
            self._add(f"{tag}_clip_frac", (layer, frac))

        return hook

    def _clip_hook(self, tag, layer):
        def hook(module, args):
            frac = (torch.linalg.vector_norm(args[0].float(), dim=-1) > module.threshold).float().mean().item()
            self._add(f"{tag}_clip_frac", (layer, frac))

        return hook

    def _swiglu_hook(self, module, args):
        gate, up = args[0].float(), args[1].float()
        self._add("gate_softcap_frac", (gate.abs() > module.gate_softcap.softcap).float().mean().item())
        self._add("up_softcap_frac", (up.abs() > module.up_softcap.softcap).float().mean().item())

    def _router_hook(self, module, args):
        flat = args[0].float().reshape(-1, module.hidden_dim)
        scores = module.score_fn(torch.nn.functional.linear(flat, module.weight.float()))
        with_bias = torch.topk(scores + module.e_score_correction_bias, module.top_k, dim=-1).indices
        by_scores = torch.topk(scores, module.top_k, dim=-1).indices
        by_bias = torch.topk(module.e_score_correction_bias.expand_as(scores), module.top_k, dim=-1).indices
        chosen = with_bias.sort(-1).values
        for tag, other in (("scores", by_scores), ("bias", by_bias)):
            differs = (chosen != other.sort(-1).values).any(-1).float().mean().item()
            self._add(f"routing_differs_from_{tag}_only_frac", differs)

    def _block_attn_hook(self, module, args):
        block_states, partial = args
        stacked = module.norm(torch.cat([block_states, partial.unsqueeze(-2)], dim=-2).float())
        if stacked.shape[-2] < 2:
            return
        hidden = stacked.shape[-1]
        query = module.query.float().view(-1, hidden)
        weights = torch.softmax(torch.einsum("qh,...sh->...qs", query, stacked) / hidden**0.5, dim=-1)
        self._add("block_attn_max_weight", weights.max(-1).values.mean().item())
        self._add("block_attn_uniform_weight", 1.0 / stacked.shape[-2])

    def _final_hook(self, module, args):
        x = args[0].float()[..., : self.tcfg.unpadded_vocab_size]
        self._add("final_logit_pre_softcap_std", x.std().item())
        self._add("final_logit_pre_softcap_absmax", x.abs().max().item())
        self._add("final_logit_softcap_frac_above_cap", (x.abs() > module.softcap).float().mean().item())

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key in ("q_clip_frac", "k_clip_frac", "rel_clip_frac"):
            per_layer = self.records.get(key, [])
            out[key + "_layer0"] = round(next(f for layer, f in per_layer if layer == 0), 4)
            out[key + "_all_layers_mean"] = round(float(np.mean([f for _, f in per_layer])), 4)
        for key in (
            "gate_softcap_frac",
            "up_softcap_frac",
            "routing_differs_from_scores_only_frac",
            "routing_differs_from_bias_only_frac",
            "block_attn_max_weight",
            "block_attn_uniform_weight",
            "final_logit_softcap_frac_above_cap",
            "final_logit_pre_softcap_std",
            "final_logit_pre_softcap_absmax",
        ):
            out[key + "_mean"] = round(float(np.mean(self.records[key])), 4)
        return out


# --------------------------------------------------------------------------------------------------
# Reference outputs
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def causal_logits(model, ids: np.ndarray) -> np.ndarray:
    out = model(torch.from_numpy(ids.astype(np.int64))[None], use_cache=False)
    return out.logits[0].float().numpy()


def image_tiles(image: np.ndarray, tile: int) -> tuple[np.ndarray, list[int]]:
    """`Inkling2ImageProcessor`'s output for one RGB uint8 image [H, W, 3] (no alpha): padded right and bottom
    to whole tiles with -1 on the 0-255 scale, normalised (x - 127.5) / 127.5 in float32, cut into tiles in raster
    order, channels last -> pixel values [rows * cols, tile, tile, 3] and the grid (1, rows, cols). Written out here
    (tensor ops only) so that the fixtures need no torchvision."""
    height, width, channels = image.shape
    rows, cols = -(-height // tile), -(-width // tile)
    padded = np.full((rows * tile, cols * tile, channels), -1.0, np.float32)
    padded[:height, :width] = image
    normalised = (padded - np.float32(127.5)) / np.float32(127.5)
    tiles = normalised.reshape(rows, tile, cols, tile, channels).transpose(0, 2, 1, 3, 4)
    return tiles.reshape(rows * cols, tile, tile, channels), [1, rows, cols]


def image_prompt(rng: np.random.Generator, grids: list[list[int]], text: list[int], vocab: int, image_id: int):
    """Random text ids around the images' placeholder runs (one placeholder per tile, contiguous, as
    `Inkling2Processor` expands them): text[0] ids, image 0, text[1] ids, image 1, ..."""
    choices = np.array([i for i in range(vocab) if i != image_id])
    parts = [rng.choice(choices, size=text[0])]
    for grid, count in zip(grids, text[1:], strict=True):
        parts += [np.full(int(np.prod(grid)), image_id), rng.choice(choices, size=count)]
    return np.concatenate(parts).astype(np.int64)


@torch.no_grad()
def image_outputs(model, ids: np.ndarray, pixel_values: np.ndarray, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tower's features [tiles, text hidden] (after the merge and projection) and the logits of one causal
    forward with the images."""
    dtype = next(model.parameters()).dtype
    pixels, grid_t = torch.from_numpy(pixel_values).to(dtype), torch.from_numpy(grid)
    features = torch.cat(model.model.get_image_features(pixels, grid_t).pooler_output)
    out = model(torch.from_numpy(ids)[None], pixel_values=pixels, image_grid_thw=grid_t, use_cache=False)
    return features.float().numpy(), out.logits[0].float().numpy()


def write_processor_config(directory: Path, tile: int) -> None:
    """preprocessor_config.json as transformers saves `Inkling2ImageProcessor`'s, with a tile of `tile` pixels."""
    settings = {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Inkling2ImageProcessor", "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 1 / 255, "size": {"height": tile, "width": tile},
    }  # fmt: skip
    (directory / "preprocessor_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def write_image_cases(spec: dict[str, Any], model, model_bf16, out_dir: Path) -> dict[str, Any]:
    """images.npz: for each image case `<case>_{input_ids, pixel_values, image_grid_thw, features_f32,
    logits_f32, features_bf16, logits_bf16}`, random pixels; returns facts for meta.json."""
    vision, tcfg = model.config.vision_config, text_config_of(model)
    tile = vision.patch_size * vision.spatial_merge_size
    rng = np.random.default_rng(spec["seed"] + 7)
    arrays: dict[str, np.ndarray] = {}
    facts: dict[str, Any] = {"tile": tile}
    (out_dir / "images").mkdir(exist_ok=True)
    for layout in ("hf", "original"):
        write_processor_config(out_dir / layout, tile)
    for case, plan in spec["image_cases"].items():
        images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in plan["images"]]
        for i, image in enumerate(images):
            Image.fromarray(image).save(out_dir / "images" / f"{case}_{i}.png")
        tiled = [image_tiles(image, tile) for image in images]
        pixel_values = np.concatenate([tiles for tiles, _ in tiled])
        grid = np.array([g for _, g in tiled], np.int64)
        ids = image_prompt(rng, grid.tolist(), plan["text"], tcfg.unpadded_vocab_size, model.config.image_token_id)
        features, logits = image_outputs(model, ids, pixel_values, grid)
        features_bf16, logits_bf16 = image_outputs(model_bf16, ids, pixel_values, grid)
        assert features.shape == (pixel_values.shape[0], tcfg.hidden_size)
        assert logits.shape == (len(ids), tcfg.unpadded_vocab_size)
        arrays |= {
            f"{case}_input_ids": ids.astype(np.int32),
            f"{case}_pixel_values": pixel_values,
            f"{case}_image_grid_thw": grid.astype(np.int32),
            f"{case}_features_f32": features,
            f"{case}_logits_f32": logits,
            f"{case}_features_bf16": features_bf16,
            f"{case}_logits_bf16": logits_bf16,
        }
        facts[case] = {
            "image_sizes": [list(size) for size in plan["images"]],
            "image_grid_thw": grid.tolist(),
            "tokens": len(ids),
            "max_abs_feature_bf16_vs_f32": round(float(np.abs(features_bf16 - features).max()), 6),
            "max_abs_logit_bf16_vs_f32": round(float(np.abs(logits_bf16 - logits).max()), 6),
        }
        print(f"  image case {case}: grids {grid.tolist()}, {len(ids)} tokens, max |feature| {abs(features).max():.2f}")
    np.savez(out_dir / "images.npz", **arrays)
    return facts


@torch.no_grad()
def greedy_recompute(model, prompt: np.ndarray, steps: int) -> np.ndarray:
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    for _ in range(steps):
        nxt = model(ids, use_cache=False).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].numpy()


@torch.no_grad()
def greedy_generate(model, prompt: np.ndarray, steps: int) -> np.ndarray:
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    # eos disabled so the continuation always has exactly `steps` tokens
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        min_new_tokens=0,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].numpy()


def eager_experts_copy(model):
    """Same weights, experts run by the plain per-expert loop instead of the default kernel."""
    other = copy.deepcopy(model)
    other.set_experts_implementation("eager")
    assert model.config.get_text_config()._experts_implementation != "eager"
    return other.eval()


def keep_fp32_patterns(model) -> list[str]:
    return sorted(model._keep_in_fp32_modules_strict)


def check_bf16_model(model_bf16, model_f32) -> list[str]:
    """Strict fp32 modules stay fp32 in a bf16 load, everything else is bf16 (round-to-nearest)."""
    patterns = keep_fp32_patterns(model_bf16)
    kept = []
    ref = model_f32.state_dict()
    for name, tensor in model_bf16.state_dict().items():
        strict = any(p in name for p in patterns)
        expected = torch.float32 if strict else torch.bfloat16
        if tensor.dtype != expected:
            raise AssertionError(f"bf16 load: {name} is {tensor.dtype}, expected {expected}")
        if not torch.equal(tensor, ref[name].to(expected)):
            raise AssertionError(f"bf16 load: {name} is not the rounded fp32 tensor")
        if strict:
            kept.append(name)
    return kept


# --------------------------------------------------------------------------------------------------
# Quantized fixtures: tiny_text with MXFP8 / NVFP4 routed experts
# --------------------------------------------------------------------------------------------------
#
# An independent numpy/torch codec (nothing shared with the JAX port); torch's float8_e4m3fn cast
# does E4M3 round-to-nearest-even, everything else is written out here and cross-checked against
# ml_dtypes. Weights are [E, N, K]; blocks run along K (the input axis), so rows are independent.
#
# MXFP8 (OCP MX v1.0): 32-blocks; scale exponent floor(log2(block amax)) - 8, clamped to
#   [-127, 127], -127 for an all-zero block, stored as the biased byte exp + 127 (E8M0); elements
#   RNE(value / 2**exp) as E4M3, saturated to +-448 first.
# NVFP4: 16-blocks; global scale per expert g = amax|W_e| / (6 * 448) (float32); block scale
#   s = block amax / (6 * g) (1.0 for a zero block), clamped to [2**-9, 448], E4M3 RNE; codes
#   E2M1 RNE of value / (float(s) * g), saturated at +-6; two codes per byte, low nibble = even index.
# Dequantized: MXFP8 e4m3 * 2**(byte - 127); NVFP4 (e2m1 * float(s)) * g (e2m1 * s is exact, so
#   this is c * s * g rounded once), all float32.

MX_BLOCK = 32
NV_BLOCK = 16
E4M3_MAX = 448.0
E4M3_EMAX = 8  # exponent of E4M3's largest normal, 448 = 1.75 * 2**8
E2M1_MAX = 6.0
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
NV_SCALE_MIN = 2.0**-9  # smallest E4M3 subnormal
MXFP8, NVFP4 = "MXFP8", "NVFP4"
MODELOPT, INKLING_V1 = "modelopt", "inkling_v1"  # namings of a quantized weight's sidecars

# Activation-side sidecars (NVFP4 only; weight-only engines ignore them): fixed positive values.
ACTIVATION_AMAX = {"w13": 6.0, "w2": 3.0}

_TORCH_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "U8": torch.uint8,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
}


def _mx_layer(data_dtype: str = "F8_E4M3", scale_dtype: str = "U8") -> dict[str, str]:
    return {"format": MXFP8, "naming": MODELOPT, "data_dtype": data_dtype, "scale_dtype": scale_dtype}


_NV_MODELOPT = {"format": NVFP4, "naming": MODELOPT}
_NV_INKLING_V1 = {"format": NVFP4, "naming": INKLING_V1}

QUANT_FIXTURES = {
    "tiny_text_mxfp8": {
        "base": "tiny_text",
        # layer 3: the same MXFP8 bytes, stored as U8 data + F8_E8M0 scales (also seen in the wild)
        "layers": {layer: _mx_layer("U8", "F8_E8M0") if layer == 3 else _mx_layer() for layer in range(12)},
        "quantization_config": {
            "quant_method": "fp8",
            "weight_block_size": [1, 32],
            "scale_fmt": "ue8m0",
            "modules_to_not_convert": ["lm_head", "model.vision_tower", "model.language_model.layers.*.self_attn"],
        },
    },
    "tiny_text_mixed": {
        "base": "tiny_text",
        "layers": {
            **dict.fromkeys(range(0, 4), _NV_MODELOPT),
            **dict.fromkeys(range(4, 8), _NV_INKLING_V1),
            **{layer: _mx_layer() for layer in range(8, 12)},
        },
        "quantization_config": {
            "quant_method": "modelopt",
            "quant_algo": "MIXED_PRECISION",
            "quantized_layers": {
                **{f"model.llm.layers.{n}.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16} for n in range(8)},
                **{f"model.llm.layers.{n}.mlp.experts": {"quant_algo": "MXFP8"} for n in range(8, 12)},
            },
        },
    },
}


def _blocks(w: np.ndarray, block: int) -> np.ndarray:
    *lead, k = w.shape
    assert k % block == 0, (w.shape, block)
    return w.reshape(*lead, k // block, block)


def e4m3_bytes(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 bytes, round-to-nearest-even (torch's cast); the caller saturates."""
    x = np.ascontiguousarray(x, np.float32)
    assert np.isfinite(x).all() and np.abs(x).max(initial=0.0) <= E4M3_MAX
    return torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def e4m3_values(b: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(b, np.uint8)).view(torch.float8_e4m3fn).float().numpy()


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 codes (bit 3 = sign), round-to-nearest-even, saturating at +-6.

    Midpoints between neighbours go to the even mantissa (0, 1, 2, 4): 0.25 -> 0, 0.75 -> 1,
    1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4."""
    x = np.asarray(x, np.float32)
    assert not np.isnan(x).any()
    mag = np.abs(x)
    steps = (mag > 0.25, mag >= 0.75, mag > 1.25, mag >= 1.75, mag > 2.5, mag >= 3.5, mag > 5.0)
    index = sum(step.astype(np.uint8) for step in steps)
    return (index | (np.signbit(x).astype(np.uint8) << 3)).astype(np.uint8)


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    mag = E2M1_MAGNITUDES[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(np.float32)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    codes = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = packed >> 4
    return codes


def mxfp8_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., K] float32 -> (E4M3 bytes [..., K], biased E8M0 scale bytes [..., K / 32])."""
    blocks = _blocks(np.asarray(w, np.float32), MX_BLOCK)
    amax = np.abs(blocks).max(-1)
    _, e = np.frexp(amax)  # amax = m * 2**e with 0.5 <= m < 1, so floor(log2(amax)) = e - 1
    exp = np.where(amax > 0, e.astype(np.int64) - 1 - E4M3_EMAX, -127).clip(-127, 127)
    scaled = np.ldexp(blocks, -exp[..., None]).astype(np.float32)  # exact (power-of-two scaling)
    data = e4m3_bytes(np.clip(scaled, -E4M3_MAX, E4M3_MAX)).reshape(w.shape)
    return data, (exp + 127).astype(np.uint8)


def mx_scale_values(scale: np.ndarray) -> np.ndarray:
    return np.ldexp(np.float32(1.0), scale.astype(np.int64) - 127).astype(np.float32)


def mxfp8_decode(data: np.ndarray, scale: np.ndarray) -> np.ndarray:
    values = _blocks(e4m3_values(data), MX_BLOCK) * mx_scale_values(scale)[..., None]
    return values.reshape(data.shape).astype(np.float32)


def nvfp4_global_scale(w: np.ndarray) -> np.ndarray:
    """One float32 per expert (leading axis): amax|W_e| / (6 * 448); 1.0 for an all-zero expert."""
    amax = np.abs(np.asarray(w, np.float32)).reshape(w.shape[0], -1).max(1)
    return np.where(amax > 0, amax / np.float32(E2M1_MAX * E4M3_MAX), np.float32(1.0)).astype(np.float32)


def nvfp4_codes(w: np.ndarray, scale: np.ndarray, g: np.ndarray) -> np.ndarray:
    """E2M1 codes [E, N, K] of w for given E4M3 block-scale bytes [E, N, K/16] and global scales [E]."""
    denom = (e4m3_values(scale) * g.reshape(-1, 1, 1)).astype(np.float32)
    return e2m1_codes(_blocks(np.asarray(w, np.float32), NV_BLOCK) / denom[..., None]).reshape(w.shape)


def nvfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[E, N, K] float32 -> (packed codes U8 [E, N, K/2], E4M3 scale bytes [E, N, K/16], g F32 [E])."""
    w = np.asarray(w, np.float32)
    g = nvfp4_global_scale(w)
    amax = np.abs(_blocks(w, NV_BLOCK)).max(-1)
    s = amax / (np.float32(E2M1_MAX) * g.reshape(-1, 1, 1))
    s = np.where(amax > 0, s, np.float32(1.0)).clip(NV_SCALE_MIN, E4M3_MAX).astype(np.float32)
    scale = e4m3_bytes(s)
    return pack_nibbles(nvfp4_codes(w, scale, g)), scale, g


def nvfp4_decode(packed: np.ndarray, scale: np.ndarray, g: np.ndarray) -> np.ndarray:
    values = _blocks(e2m1_values(unpack_nibbles(packed)), NV_BLOCK) * e4m3_values(scale)[..., None]
    values = values.astype(np.float32) * g.reshape(-1, 1, 1, 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 2).astype(np.float32)


def interleave_rows(a: np.ndarray) -> np.ndarray:
    """numpy twin of `interleave_gate_up` for data or scales [E, 2I, X]: rows gate_j, up_j alternate."""
    experts, rows, width = a.shape
    return a.reshape(experts, 2, rows // 2, width).transpose(0, 2, 1, 3).reshape(experts, rows, width)


def deinterleave_rows(a: np.ndarray) -> np.ndarray:
    experts, rows, width = a.shape
    return a.reshape(experts, rows // 2, 2, width).transpose(0, 2, 1, 3).reshape(experts, rows, width)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_codecs() -> list[str]:
    """The codec against ml_dtypes on every code, on ties and on the edge cases of the scale rules."""
    checks = []
    every = np.arange(256, dtype=np.uint8)
    finite = every[(every & 0x7F) != 0x7F]  # 0x7F / 0xFF are E4M3's NaNs
    assert _bits_equal(e4m3_values(finite), finite.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    grid = np.unique(np.abs(e4m3_values(finite)))
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)  # exact in float32
    probe = np.concatenate([grid, mids, np.random.default_rng(0).uniform(-448, 448, 4096).astype(np.float32)])
    probe = np.concatenate([probe, -probe, [np.float32(1e-30), np.float32(-1e-30)]]).astype(np.float32)
    assert _bits_equal(e4m3_bytes(probe), probe.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
    checks.append(
        "E4M3: 254 finite bytes decode and grid values, midpoints (ties), 8192 uniform draws encode as ml_dtypes"
    )

    biased = np.arange(255, dtype=np.uint8)  # 0xFF is E8M0's NaN
    assert _bits_equal(mx_scale_values(biased), biased.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    assert _bits_equal(mx_scale_values(biased).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8), biased)
    checks.append("E8M0: bytes 0..254 decode to 2**(b-127) as ml_dtypes, and encode back")

    codes = np.arange(16, dtype=np.uint8)
    assert _bits_equal(e2m1_values(codes), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32))
    mag = E2M1_MAGNITUDES
    probe = np.concatenate([mag, (mag[1:] + mag[:-1]) / 2, np.random.default_rng(1).uniform(0, 6, 4096)])
    probe = np.concatenate([probe, -probe]).astype(np.float32)
    assert _bits_equal(e2m1_codes(probe), probe.astype(ml_dtypes.float4_e2m1fn).view(np.uint8))
    assert _bits_equal(e2m1_codes(np.float32([6.5, 100, -7])), np.uint8([7, 7, 15]))
    assert _bits_equal(e2m1_codes(e2m1_values(codes)), codes)
    checks.append("E2M1: 16 codes decode, grid/midpoint (ties)/uniform values encode as ml_dtypes; saturation at +-6")

    # MXFP8 rules: zero block, saturation (block amax / 2**exp in [448, 512)), exponent clamp
    w = np.zeros((2, 64), np.float32)
    w[1, :32] = np.linspace(-1, 1, 32)
    w[1, 5] = 1.9375  # block exponent -8: 1.9375 * 2**8 = 496 > 448 saturates
    w[1, 32:] = 2.0**-140  # subnormal block: exponent clamps at -127
    data, scale = mxfp8_encode(w)
    assert scale.tolist() == [[0, 0], [127 - 8, 0]], scale  # floor(log2(1.9375)) - 8 = -8
    assert not data[0].any() and data[1, 5] == 0x7E  # 448
    assert _bits_equal(mxfp8_encode(mxfp8_decode(data, scale))[0], data)
    checks.append("MXFP8: zero block -> scale byte 0 (2**-127); 496 saturates to 448 (0x7E); exponent clamp at -127")

    # NVFP4 rules: zero block -> scale 1.0 (0x38); the expert's largest block gets s = 448 (0x7E)
    w = np.zeros((2, 1, 32), np.float32)
    w[0, 0, 16:] = np.linspace(-3, 2, 16)
    packed, scale, g = nvfp4_encode(w)
    assert scale[0, 0].tolist() == [0x38, 0x7E] and scale[1, 0].tolist() == [0x38, 0x38] and g[1] == 1.0
    assert not packed[:, :, :8].any() and unpack_nibbles(packed)[0, 0, 16] == 0x0F  # -6
    assert _bits_equal(nvfp4_codes(nvfp4_decode(packed, scale, g), scale, g), unpack_nibbles(packed))
    checks.append(
        "NVFP4: zero block -> scale 1.0 (0x38); expert amax block -> scale 448, code -6 (0xF); zero expert -> g 1.0"
    )
    return checks


def _quantized_tensors(base: str, plan: dict[str, str], logical: np.ndarray, interleave: bool):
    """Checkpoint tensors (name -> (safetensors dtype, array)) of one expert weight `base`
    (`...mlp.experts.w13` / `w2`) of logical [E, N, K] values, and its dequantized values."""
    fmt, naming = plan["format"], plan["naming"]
    rows = interleave_rows if interleave else (lambda a: a)
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    if fmt == MXFP8:
        data, scale = mxfp8_encode(logical)
        dequant = mxfp8_decode(data, scale)
        tensors[f"{base}_weight"] = (plan["data_dtype"], rows(data))
        tensors[f"{base}_weight_scale"] = (plan["scale_dtype"], rows(scale))
        return tensors, dequant
    packed, scale, g = nvfp4_encode(logical)
    dequant = nvfp4_decode(packed, scale, g)
    act_amax = ACTIVATION_AMAX[base.rsplit(".", 1)[1]]
    tensors[f"{base}_weight"] = ("U8", rows(packed))
    if naming == MODELOPT:
        tensors[f"{base}_weight_scale"] = ("F8_E4M3", rows(scale))
        tensors[f"{base}_weight_scale_2"] = ("F32", g)
        tensors[f"{base}_input_scale"] = ("F32", np.float32(act_amax / (E2M1_MAX * E4M3_MAX)).reshape(()))
    else:
        tensors[f"{base}_weight.scale"] = ("F8_E4M3", rows(scale))
        tensors[f"{base}_weight.scale2"] = ("F32", g)
        tensors[f"{base}_weight.input_amax"] = ("BF16", np.float32([act_amax]))
        tensors[f"{base}_weight.original_shape"] = ("I64", np.int64(logical.shape))
    return tensors, dequant


def _to_torch(dtype: str, array: np.ndarray) -> torch.Tensor:
    if dtype in ("F8_E4M3", "F8_E8M0", "U8"):
        assert array.dtype == np.uint8
        return torch.from_numpy(np.ascontiguousarray(array)).view(_TORCH_DTYPES[dtype]).clone()
    return torch.from_numpy(np.array(array, order="C")).to(_TORCH_DTYPES[dtype])  # (keeps 0-d shapes)


def _read_safetensors_header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    header.pop("__metadata__", None)
    return header


def _expert_from_file(sd: dict[str, torch.Tensor], base: str, plan: dict[str, str]) -> dict[str, np.ndarray]:
    """Decode one expert weight from the tensors as loaded back from the file (original rows)."""

    def raw(name):
        return sd[name].view(torch.uint8).numpy() if sd[name].element_size() == 1 else sd[name].numpy()

    if plan["format"] == MXFP8:
        data, scale = raw(f"{base}_weight"), raw(f"{base}_weight_scale")
        return {"data": data, "scale": scale, "values": mxfp8_decode(data, scale)}
    scale_name = f"{base}_weight_scale" if plan["naming"] == MODELOPT else f"{base}_weight.scale"
    global_name = f"{base}_weight_scale_2" if plan["naming"] == MODELOPT else f"{base}_weight.scale2"
    packed, scale, g = raw(f"{base}_weight"), raw(scale_name), sd[global_name].float().numpy()
    return {"data": packed, "scale": scale, "g": g, "values": nvfp4_decode(packed, scale, g)}


def _ml_dtypes_decode(item: dict[str, np.ndarray], fmt: str) -> np.ndarray:
    """Second decoder for the stored bytes, on ml_dtypes' conversions."""
    if fmt == MXFP8:
        vals = _blocks(item["data"].view(ml_dtypes.float8_e4m3fn).astype(np.float32), MX_BLOCK)
        out = vals * item["scale"].view(ml_dtypes.float8_e8m0fnu).astype(np.float32)[..., None]
        return out.reshape(item["data"].shape)
    codes = unpack_nibbles(item["data"]).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    vals = _blocks(codes, NV_BLOCK) * item["scale"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)[..., None]
    return (vals * item["g"].reshape(-1, 1, 1, 1)).reshape(codes.shape)


def _ml_dtypes_encode_matches(logical: np.ndarray, item: dict[str, np.ndarray], fmt: str) -> bool:
    """ml_dtypes' casts of the logical weights, scaled by the stored scales, give the stored bytes."""
    if fmt == MXFP8:
        step = item["scale"].view(ml_dtypes.float8_e8m0fnu).astype(np.float32)[..., None]
        scaled = np.clip(_blocks(logical, MX_BLOCK) / step, -E4M3_MAX, E4M3_MAX).reshape(logical.shape)
        return _bits_equal(scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), item["data"])
    g = item["g"].reshape(-1, 1, 1)
    amax = np.abs(_blocks(logical, NV_BLOCK)).max(-1)
    s = np.where(amax > 0, amax / (np.float32(E2M1_MAX) * g), 1).clip(NV_SCALE_MIN, E4M3_MAX).astype(np.float32)
    if not _bits_equal(s.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), item["scale"]):
        return False
    denom = item["scale"].view(ml_dtypes.float8_e4m3fn).astype(np.float32) * g
    scaled = np.clip(_blocks(logical, NV_BLOCK) / denom[..., None], -E2M1_MAX, E2M1_MAX).reshape(logical.shape)
    return _bits_equal(scaled.astype(ml_dtypes.float4_e2m1fn).view(np.uint8), unpack_nibbles(item["data"]))


def make_quant_fixture(name: str, qspec: dict[str, Any], out_root: Path, codec_checks: list[str]) -> dict[str, Any]:
    print(f"\n=== {name} ===")
    base_name = qspec["base"]
    spec = FIXTURES[base_name]
    assert spec["kind"] == "text"
    base, _, input_ids = build_model(spec)
    tcfg = text_config_of(base)
    num_layers, experts = tcfg.num_hidden_layers, tcfg.n_routed_experts
    assert sorted(qspec["layers"]) == list(range(num_layers))
    base_sd = base.state_dict()

    # original layout: tiny_text's float32 tensors, the expert weights replaced by quantized ones
    original = to_original_state_dict(base_sd, "text")
    dequant_model = copy.deepcopy(base).eval()
    params = dict(dequant_model.named_parameters())
    tensors: dict[str, tuple[str, np.ndarray]] = {}
    logical: dict[str, np.ndarray] = {}
    layer_meta: dict[str, Any] = {}
    for layer, plan in sorted(qspec["layers"].items()):
        prefix = f"model.llm.layers.{layer}.mlp.experts"
        layer_tensors: dict[str, tuple[str, np.ndarray]] = {}
        errors = {}
        for short, param, interleave in (("w13", "gate_up_proj", True), ("w2", "down_proj", False)):
            hf_name = f"model.layers.{layer}.mlp.experts.{param}"
            weight = base_sd[hf_name].numpy()
            assert weight.shape[0] == experts
            del original[f"{prefix}.{short}_weight"]
            quantized, dequant = _quantized_tensors(f"{prefix}.{short}", plan, weight, interleave)
            layer_tensors.update(quantized)
            logical[f"{prefix}.{short}"] = weight
            with torch.no_grad():
                params[hf_name].copy_(torch.from_numpy(dequant))
            errors[short] = float(np.sqrt(np.mean((dequant - weight) ** 2) / np.mean(weight**2)))
        tensors.update(layer_tensors)
        layer_meta[str(layer)] = {
            **plan,
            "relative_rms_error": {k: round(v, 6) for k, v in errors.items()},
            "tensors": {k: {"dtype": d, "shape": list(a.shape)} for k, (d, a) in sorted(layer_tensors.items())},
        }
    checkpoint = {**original, **{k: _to_torch(d, a) for k, (d, a) in tensors.items()}}
    assert set(original).isdisjoint(tensors)
    dq = {n: p.detach() for n, p in dequant_model.named_parameters()}
    for hf_name, tensor in base_sd.items():  # only the expert parameters changed
        changed = not torch.equal(dq[hf_name], tensor) if hf_name in dq else False
        assert changed == hf_name.endswith(("experts.gate_up_proj", "experts.down_proj")), hf_name

    out_dir = out_root / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    original_dir = out_dir / "original"
    original_dir.mkdir(parents=True)
    config_dict = _drop_version(json.loads(base.config.to_json_string(use_diff=True)))
    base_cfg_file = out_root / base_name / "original" / "config.json"
    if base_cfg_file.exists():
        assert json.loads(base_cfg_file.read_text()) == config_dict, f"config differs from {base_cfg_file}"
    config_dict["quantization_config"] = qspec["quantization_config"]
    (original_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    weights_file = original_dir / "model.safetensors"
    save_file(checkpoint, str(weights_file), metadata={"format": "pt"})

    # Proofs on the written file: header dtypes/shapes, non-expert tensors, decode == model parameters
    header = _read_safetensors_header(weights_file)
    assert set(header) == set(checkpoint)
    for tname, (dtype, array) in tensors.items():
        assert header[tname]["dtype"] == dtype and header[tname]["shape"] == list(array.shape), (tname, header[tname])
    loaded = load_file(str(weights_file))
    base_file = out_root / base_name / "original" / "model.safetensors"
    base_on_disk = load_file(str(base_file)) if base_file.exists() else None
    for tname, tensor in original.items():
        assert header[tname]["dtype"] == "F32" and torch.equal(loaded[tname], tensor), tname
        if base_on_disk is not None:
            assert torch.equal(base_on_disk[tname], loaded[tname]), f"{tname} differs from {base_file}"
    if base_on_disk is not None:
        assert set(base_on_disk) - set(original) == {
            f"model.llm.layers.{n}.mlp.experts.{w}_weight" for n in range(num_layers) for w in ("w13", "w2")
        }
        print(f"  non-expert tensors identical to {base_file.relative_to(out_root)}")
    for layer, plan in sorted(qspec["layers"].items()):
        fmt = plan["format"]
        for short, param in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            wbase = f"model.llm.layers.{layer}.mlp.experts.{short}"
            item = _expert_from_file(loaded, wbase, plan)
            rows = deinterleave_rows if short == "w13" else (lambda a: a)
            file_logical = logical[wbase] if short == "w2" else interleave_rows(logical[wbase])
            # decode(file) with rows restored is exactly the parameter the reference model runs on
            hf_param = dq[f"model.layers.{layer}.mlp.experts.{param}"].numpy()
            assert _bits_equal(rows(item["values"]), hf_param), wbase
            assert _bits_equal(_ml_dtypes_decode(item, fmt), item["values"]), wbase
            assert _ml_dtypes_encode_matches(file_logical, item, fmt), wbase
            # the decoder inverts the encoder: re-encoding the decoded values gives the same bytes
            # (for NVFP4 also the re-derived scales: a normal E4M3 block scale is within 1/16 of
            # amax / (6 g), so the block's largest code is 6 again; true for every block here)
            if fmt == MXFP8:
                again = mxfp8_encode(item["values"])
                assert _bits_equal(again[0], item["data"]) and _bits_equal(again[1], item["scale"]), wbase
            else:
                codes = nvfp4_codes(item["values"], item["scale"], item["g"])
                assert _bits_equal(codes, unpack_nibbles(item["data"])), wbase
                packed, scale, g = nvfp4_encode(item["values"])
                assert _bits_equal(packed, item["data"]) and _bits_equal(scale, item["scale"]), wbase
                assert _bits_equal(g, item["g"]), wbase
    print("  written bytes decode (numpy/torch and ml_dtypes) to the reference model's expert weights")

    # Reference outputs on the dequantized model
    logits_f32 = causal_logits(dequant_model, input_ids)
    logits_base = causal_logits(base, input_ids)
    diff = np.abs(logits_f32 - logits_base)
    eager_diff = float(np.abs(causal_logits(eager_experts_copy(dequant_model), input_ids) - logits_f32).max())
    prompt = input_ids[:GREEDY_PROMPT_LEN].copy()
    recompute = greedy_recompute(dequant_model, prompt, GREEDY_NEW_TOKENS)
    cached = greedy_generate(dequant_model, prompt, GREEDY_NEW_TOKENS)
    generate_matches = cached.shape == recompute.shape and bool((cached == recompute).all())
    if not generate_matches:
        print(f"  WARNING: cached generate {cached.tolist()} != full recompute {recompute.tolist()}", file=sys.stderr)
    greedy_ids = cached if generate_matches else recompute
    greedy_base = greedy_generate(base, prompt, GREEDY_NEW_TOKENS)
    differs = np.nonzero(greedy_ids != greedy_base)[0]
    print(f"  max |dequantized - {base_name}| logits = {diff.max():.4f} (mean {diff.mean():.4f})")
    print(f"  argmax agreement with {base_name}: {(logits_f32.argmax(-1) == logits_base.argmax(-1)).mean():.3f}")
    print(f"  greedy: {greedy_ids.tolist()}")
    print(f"  {base_name}: {greedy_base.tolist()} ({len(differs)} of {GREEDY_NEW_TOKENS} tokens differ)")
    print(f"  f32 noise floor: max |eager experts - default experts| logits = {eager_diff:.2e}")

    vocab = tcfg.unpadded_vocab_size
    assert logits_f32.shape == (spec["seq_len"], vocab)
    np.savez(
        out_dir / "reference.npz",
        input_ids=input_ids.astype(np.int32),
        logits_f32=logits_f32.astype(np.float32),
        greedy_prompt=prompt.astype(np.int32),
        greedy_ids=greedy_ids.astype(np.int32),
    )
    by_kind: dict[str, list[int]] = {}
    for layer, plan in sorted(qspec["layers"].items()):
        tag = f"{plan['format']} {plan['naming']}"
        if plan["format"] == MXFP8:
            tag += f" (data {plan['data_dtype']}, scale {plan['scale_dtype']})"
        by_kind.setdefault(tag, []).append(layer)
    meta = {
        "name": name,
        "base": base_name,
        "model_class": type(base).__name__,
        "model_type": base.config.model_type,
        "seed": spec["seed"],
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "safetensors": safetensors.__version__,
            "ml_dtypes": ml_dtypes.__version__,
            "numpy": np.__version__,
        },
        "experts_implementation": getattr(tcfg, "_experts_implementation", None),
        "note": (
            f"original/ holds {base_name}'s float32 weights with quantized routed experts; reference.npz "
            "is transformers run in float32 on the dequantized expert weights"
        ),
        "layers_by_format": by_kind,
        "quantization_config": qspec["quantization_config"],
        "formats": {
            MXFP8: "32-blocks along K; exp = floor(log2(amax)) - 8 clamped to [-127, 127] (-127 for zero "
            "blocks), stored as byte exp + 127; data RNE(x / 2**exp) as E4M3, saturated at 448; "
            "value = e4m3 * 2**(byte - 127)",
            NVFP4: "16-blocks along K; g[e] = amax|W_e| / 2688 (float32); s = block amax / (6 g) (1.0 for a "
            "zero block) clamped to [2**-9, 448], E4M3 RNE; codes E2M1 RNE of x / (s g), saturated at 6, "
            "byte = c[2i] | c[2i+1] << 4; value = e2m1 * s * g",
            "w13_rows": "quantized per row in the transformers order, then data and block scales interleaved "
            "(row 2j = gate j, row 2j+1 = up j); global scales are per expert",
            "activation_sidecars": f"input_scale = amax / 2688, input_amax = amax, amax = {ACTIVATION_AMAX} "
            "(arbitrary, ignored by weight-only engines)",
        },
        "layers": layer_meta,
        "codec_checks": [
            *codec_checks,
            "per weight: file bytes decode (this codec and ml_dtypes) bit-exactly to the reference model's "
            "parameters (rows de-interleaved); ml_dtypes casts of weight / stored scales give the stored bytes",
            "MXFP8: re-encoding the decoded values reproduces data and scale bytes",
            "NVFP4: re-encoding the decoded values reproduces the codes (with the stored scales) and, "
            "re-deriving the scales, the packed bytes, block-scale bytes and global scales",
        ],
        "reference": {
            f"max_abs_logit_diff_vs_{base_name}": round(float(diff.max()), 6),
            f"mean_abs_logit_diff_vs_{base_name}": round(float(diff.mean()), 6),
            f"argmax_agreement_vs_{base_name}": round(
                float((logits_f32.argmax(-1) == logits_base.argmax(-1)).mean()), 4
            ),
            f"greedy_{base_name}": greedy_base.tolist(),
            "greedy": greedy_ids.tolist(),
            "greedy_tokens_differing": len(differs),
            "greedy_first_difference_at": int(differs[0]) if len(differs) else None,
            "generate_matches_recompute": generate_matches,
        },
        "f32_noise_floor": {"max_abs_logit_diff_eager_experts": eager_diff},
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    for path in out_dir.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o644)
    return meta


# --------------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------------


def build_model(spec: dict[str, Any]):
    """The randomized float32 model of a fixture spec and its input ids (deterministic)."""
    torch.manual_seed(spec["seed"])
    config = build_config(spec)
    model = model_class(spec)(config)
    model.eval()
    init_plan = randomize_(model, spec["seed"], spec["stds"])
    if "image_cases" in spec:
        scale_vision_(model, init_plan)
    check_nontrivial(model.state_dict())
    tcfg = text_config_of(model)

    rng = np.random.default_rng(spec["seed"])
    input_ids = rng.integers(0, tcfg.unpadded_vocab_size, size=spec["seq_len"]).astype(np.int32)
    return model, init_plan, input_ids


def make_fixture(name: str, spec: dict[str, Any], out_root: Path) -> dict[str, Any]:
    print(f"\n=== {name} ===")
    model, init_plan, input_ids = build_model(spec)
    tcfg = text_config_of(model)

    with StatsCollector(model) as stats:
        logits_f32 = causal_logits(model, input_ids)
    summary = stats.summary()
    for key, value in summary.items():
        print(f"  {key:45s} {value}")

    out_dir = out_root / name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    hf_dir, original_dir = out_dir / "hf", out_dir / "original"
    hf_files = write_hf(model, hf_dir, sharded=spec["sharded"])
    write_original(model, spec["kind"], original_dir)
    facts = prove_loading(spec, model, hf_dir, original_dir, input_ids, logits_f32)
    print("  original/ and hf/ reload exactly (no missing/unexpected/mismatched keys)")

    # bf16: load the saved transformers-layout model with dtype=bfloat16
    model_bf16 = model_class(spec).from_pretrained(str(hf_dir), dtype=torch.bfloat16)
    model_bf16.eval()
    kept_fp32 = check_bf16_model(model_bf16, model)
    logits_bf16 = causal_logits(model_bf16, input_ids)
    bf16_err = float(np.abs(logits_bf16 - logits_f32).max())
    eager_diff = float(np.abs(causal_logits(eager_experts_copy(model), input_ids) - logits_f32).max())
    print(f"  f32 noise floor: max |eager experts - default experts| logits = {eager_diff:.2e}")
    reload_diffs = ", ".join(f"{k} {v:.2e}" for k, v in facts["f32_reload_logit_diff"].items())
    print(f"  f32 noise floor: max |reloaded - source| logits: {reload_diffs}")
    print(f"  bf16 load keeps {len(kept_fp32)} tensors fp32; max |bf16 - f32| logits = {bf16_err:.4f}")

    prompt = input_ids[:GREEDY_PROMPT_LEN].copy()
    recompute = greedy_recompute(model, prompt, GREEDY_NEW_TOKENS)
    cached = greedy_generate(model, prompt, GREEDY_NEW_TOKENS)
    generate_matches = cached.shape == recompute.shape and bool((cached == recompute).all())
    if generate_matches:
        greedy_ids = cached
        print(f"  greedy (generate == recompute): {greedy_ids.tolist()}")
    else:
        print(
            f"  WARNING: cached generate {cached.tolist()} != full recompute {recompute.tolist()};"
            " saving the recompute version",
            file=sys.stderr,
        )
        greedy_ids = recompute

    vocab = tcfg.unpadded_vocab_size
    assert logits_f32.shape == (spec["seq_len"], vocab) and logits_bf16.shape == logits_f32.shape
    image_facts = write_image_cases(spec, model, model_bf16, out_dir) if "image_cases" in spec else None
    np.savez(
        out_dir / "reference.npz",
        input_ids=input_ids.astype(np.int32),
        logits_f32=logits_f32.astype(np.float32),
        logits_bf16=logits_bf16.astype(np.float32),
        greedy_prompt=prompt.astype(np.int32),
        greedy_ids=greedy_ids.astype(np.int32),
    )

    meta = {
        "name": name,
        "model_class": type(model).__name__,
        "model_type": model.config.model_type,
        "seed": spec["seed"],
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
        "experts_implementation": getattr(tcfg, "_experts_implementation", None),
        "attn_implementation": tcfg._attn_implementation,
        "hf_weight_files": hf_files,
        "init_stds": spec["stds"],
        "init_plan": init_plan,
        "stats": summary,
        "bf16": {
            "keep_in_fp32_modules_strict": keep_fp32_patterns(model_bf16),
            "tensors_kept_fp32": kept_fp32,
            "max_abs_logit_diff_vs_f32": round(bf16_err, 6),
            "mean_abs_logit_diff_vs_f32": round(float(np.abs(logits_bf16 - logits_f32).mean()), 6),
            "argmax_agreement_vs_f32": round(float((logits_bf16.argmax(-1) == logits_f32.argmax(-1)).mean()), 4),
        },
        "f32_noise_floor": {
            "note": "logits_f32 use the default experts implementation; this is the max |diff| to the eager one",
            "max_abs_logit_diff_eager_experts": eager_diff,
        },
        "greedy": {
            "generate_matches_recompute": generate_matches,
            "generate": cached.tolist(),
            "recompute": recompute.tolist(),
        },
        **facts,
    }
    if image_facts is not None:
        meta["images"] = image_facts
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    for path in out_dir.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o644)
    return meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--only", choices=sorted(FIXTURES) + sorted(QUANT_FIXTURES), action="append")
    parser.add_argument("--allow-version-mismatch", action="store_true")
    args = parser.parse_args()

    versions_ok = transformers.__version__ == PINNED_TRANSFORMERS and torch.__version__.split("+")[0] == PINNED_TORCH
    if not versions_ok:
        msg = (
            f"expected transformers=={PINNED_TRANSFORMERS}, torch=={PINNED_TORCH}; "
            f"found {transformers.__version__}, {torch.__version__}"
        )
        if not args.allow_version_mismatch:
            raise SystemExit(msg)
        print("WARNING: " + msg, file=sys.stderr)

    torch.set_grad_enabled(False)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    selected = args.only or [*sorted(FIXTURES), *sorted(QUANT_FIXTURES)]
    for name in selected:
        if name in FIXTURES:
            make_fixture(name, FIXTURES[name], args.out)
    codec_checks = check_codecs() if any(name in QUANT_FIXTURES for name in selected) else []
    for name in selected:
        if name in QUANT_FIXTURES:
            make_quant_fixture(name, QUANT_FIXTURES[name], args.out, codec_checks)
    print(f"\nfixtures written under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
