"""Checkpoint tensor names -> parameter paths of `CausalLM`, for every layout Inkling 2 ships in.

Our parameter paths are transformers' `Inkling2ForCausalLM` names. Layouts:
- "original": the released checkpoints (`model.llm.*`, `model.visual.*`): fused `w13_weight` with gate
  and up rows interleaved, `attn_res.attn_queries.{i}` belonging to layer i + 1, ...
- "transformers": `model.*` + `lm_head.weight` (Inkling2ForCausalLM) or `model.language_model.*` +
  `model.vision_tower.*` + `lm_head.weight` (Inkling2ForConditionalGeneration).
Vision-tower tensors are recognised and left to the image tower; `k_l2_clip` tensors are ignored, as
transformers ignores them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import numpy as np

ORIGINAL = "original"
TRANSFORMERS = "transformers"
VISION_PREFIXES = ("model.visual.", "model.vision_tower.")

Transform = Callable[[np.ndarray], np.ndarray]


def deinterleave_rows(w13: np.ndarray) -> np.ndarray:
    """[E, 2I, H] with rows (gate_0, up_0, gate_1, up_1, ...) -> gate rows then up rows."""
    experts, rows, hidden = w13.shape
    return w13.reshape(experts, rows // 2, 2, hidden).transpose(0, 2, 1, 3).reshape(experts, rows, hidden)


def _identity(array: np.ndarray) -> np.ndarray:
    return array


# Original names inside `model.llm.layers.{i}.` -> transformers names inside `model.layers.{i}.`.
_ORIGINAL_LAYER = [
    (r"attn\.wq_du\.", "self_attn.q_proj."),
    (r"attn\.wk_dv\.", "self_attn.k_proj."),
    (r"attn\.wv_dv\.", "self_attn.v_proj."),
    (r"attn\.wr_du\.", "self_attn.r_proj."),
    (r"attn\.wo_ud\.", "self_attn.o_proj."),
    (r"attn\.gate_attn\.", "self_attn.gate_proj."),
    (r"attn\.attn_sink_proj\.", "self_attn.sink_proj."),
    (r"attn\.(q_l2_clip|rel_l2_clip|rel_logits_proj)\.", r"self_attn.\1."),
    (r"attn\.([kv])_sconv\.weight$", r"self_attn.\1_sconv.conv1d.weight"),
    (r"attn\.([kv])_sconv\.static_w$", r"self_attn.\1_sconv.static_weight"),
    (r"attn\.([kv])_sconv\.weight_proj$", r"self_attn.\1_sconv.weight_proj.weight"),
    (r"attn_sconv\.weight$", "post_attention_convolution.conv1d.weight"),
    (r"mlp_sconv\.weight$", "post_mlp_convolution.conv1d.weight"),
    (r"attn_norm\.", "input_layernorm."),
    (r"mlp_norm\.", "post_attention_layernorm."),
    (r"([qkv])_input_norm\.", r"\1_input_layernorm."),
    (r"mlp\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"mlp\.gate\.weight$", "mlp.gate.weight"),
    (r"mlp\.experts\.w13_weight$", "mlp.experts.gate_up_proj"),
    (r"mlp\.experts\.w2_weight$", "mlp.experts.down_proj"),
]
_ORIGINAL_TOP = {
    "model.llm.unembed.weight": "lm_head.weight",
    "model.llm.embed.weight": "model.embed_tokens.weight",
    "model.llm.embed_norm.weight": "model.embed_tokens.embed_norm.weight",
    "model.llm.norm.weight": "model.norm.weight",
    "model.llm.attn_res.output_query": "model.final_input.query",
}


def _original_to_transformers(name: str) -> str | None:
    if name in _ORIGINAL_TOP:
        return _ORIGINAL_TOP[name]
    if m := re.fullmatch(r"model\.llm\.attn_res\.attn_queries\.(\d+)", name):
        return f"model.layers.{int(m.group(1)) + 1}.attention_input.query"
    if m := re.fullmatch(r"model\.llm\.attn_res\.mlp_queries\.(\d+)", name):
        return f"model.layers.{m.group(1)}.mlp_input.query"
    if m := re.fullmatch(r"model\.llm\.layers\.(\d+)\.(.+)", name):
        for pattern, replacement in _ORIGINAL_LAYER:
            renamed, count = re.subn("^" + pattern, replacement, m.group(2))
            if count:
                return f"model.layers.{m.group(1)}.{renamed}"
    return None


def detect_layout(names: Iterable[str]) -> str:
    """ "original" when the checkpoint uses `model.llm.*` names, else "transformers"."""
    return ORIGINAL if any(name.startswith("model.llm.") for name in names) else TRANSFORMERS


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def is_ignored(name: str) -> bool:
    """Tensors transformers' conversion renames but its model has no parameter for: the key L2 clip
    has a fixed threshold, so a stored `k_l2_clip` tensor does not take part in the reference's math."""
    return ".k_l2_clip." in name


def text_parameter(name: str, layout: str) -> tuple[str, Transform] | None:
    """(our parameter path, transform to apply) for a checkpoint tensor, or None if it is not one."""
    if layout == ORIGINAL:
        target = _original_to_transformers(name)
    elif name.startswith("model.language_model."):
        target = "model." + name.removeprefix("model.language_model.")
    else:
        target = name
    if target is None:
        return None
    transform = deinterleave_rows if name.endswith("mlp.experts.w13_weight") else _identity
    return target, transform
