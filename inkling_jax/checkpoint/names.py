"""Checkpoint tensor names -> parameter paths of `CausalLM`, for every layout Inkling 2 ships in.

Our parameter paths are transformers' `Inkling2ForCausalLM` names. Layouts:
- "original": the released checkpoints (`model.llm.*`, `model.visual.*`): fused `w13_weight` with gate
  and up rows interleaved, `attn_res.attn_queries.{i}` belonging to layer i + 1, ...
- "transformers": `model.*` + `lm_head.weight` (Inkling2ForCausalLM) or `model.language_model.*` +
  `model.vision_tower.*` + `lm_head.weight` (Inkling2ForConditionalGeneration).
The image tower's tensors (`model.visual.*` in the original layout, `model.vision_tower.*` in transformers')
fill `vision_tower.*`, named as transformers' `Inkling2VisionModel` names them; `k_l2_clip` tensors are ignored,
as transformers ignores them.

The DSpark draft's tensors are `dspark.*` in every layout, named after DeepSpec's DSpark modules; each is
the parameter of the same path (`CausalLM.dspark`). With m = len(target_layer_ids), d the hidden size,
r = markov_rank, V = vocab_size (padded), H / Hkv / D / I the draft's heads, KV heads, head dim and MLP width:

    dspark.fc.weight                                  [d, m*d]   context projection (no bias)
    dspark.hidden_norm.weight                         [d]        RMSNorm of the context features
    dspark.layers.{i}.input_layernorm.weight          [d]
    dspark.layers.{i}.self_attn.q_proj.weight         [H*D, d]
    dspark.layers.{i}.self_attn.k_proj.weight         [Hkv*D, d] (context features and block states)
    dspark.layers.{i}.self_attn.v_proj.weight         [Hkv*D, d]
    dspark.layers.{i}.self_attn.o_proj.weight         [d, H*D]
    dspark.layers.{i}.self_attn.q_norm.weight         [D]
    dspark.layers.{i}.self_attn.k_norm.weight         [D]
    dspark.layers.{i}.post_attention_layernorm.weight [d]
    dspark.layers.{i}.mlp.gate_proj.weight            [I, d]
    dspark.layers.{i}.mlp.up_proj.weight              [I, d]
    dspark.layers.{i}.mlp.down_proj.weight            [d, I]
    dspark.norm.weight                                [d]        final norm before the shared LM head
    dspark.markov_head.markov_w1.weight               [V, r]     W1, previous-token embedding
    dspark.markov_head.markov_w2.weight               [V, r]     W2, state -> vocabulary bias
    dspark.markov_head.joint_proj.weight              [3r, 2r+d] W_j, rows: gate, candidate, output
    dspark.markov_head.joint_proj.bias                [3r]
    dspark.confidence_head.proj.weight                [1, d+r]
    dspark.confidence_head.proj.bias                  [1]

No embedding or LM head: the draft uses the target's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

ORIGINAL = "original"
TRANSFORMERS = "transformers"
VISION_PREFIXES = ("model.visual.", "model.vision_tower.")
VISION_PATH = "vision_tower."  # where the tower's parameters sit in `CausalLM`
DRAFT_PREFIX = "dspark."

Index = tuple[slice, ...]


def deinterleave_rows(w13: np.ndarray) -> np.ndarray:
    """[E, 2I, X] with rows (gate_0, up_0, gate_1, up_1, ...) -> gate rows then up rows (X: the input
    width, or its packed codes or block scales, which follow their rows)."""
    experts, rows, hidden = w13.shape
    return w13.reshape(experts, rows // 2, 2, hidden).transpose(0, 2, 1, 3).reshape(experts, rows, hidden)


def _identity(array: np.ndarray) -> np.ndarray:
    return array


class Transform(NamedTuple):
    """A stored tensor -> parameter map that works slice by slice, so a shard is computed from the
    stored slice it covers. `whole` are the axes `apply` mixes: a slice is read whole along them and
    cut after `apply`; every other axis maps one to one and is cut before anything is read."""

    apply: Callable[[np.ndarray], np.ndarray]
    whole: tuple[int, ...] = ()

    def source(self, index: Index) -> Index:
        """The slice of the stored tensor that the parameter's `index` slice is computed from."""
        return tuple(slice(None) if axis in self.whole else part for axis, part in enumerate(index))

    def __call__(self, source: np.ndarray, index: Index) -> np.ndarray:
        """The parameter's `index` slice, from the stored tensor's `self.source(index)` slice."""
        return self.apply(source)[tuple(part if axis in self.whole else slice(None) for axis, part in enumerate(index))]


IDENTITY = Transform(_identity)
# gate/up rows are interleaved within each expert: experts and input columns slice freely, rows are read whole
DEINTERLEAVE = Transform(deinterleave_rows, whole=(1,))


# Original names inside `model.llm.layers.{i}.` -> transformers names inside `model.layers.{i}.`.
_ORIGINAL_LAYER = {
    "attn.wq_du.weight": "self_attn.q_proj.weight",
    "attn.wk_dv.weight": "self_attn.k_proj.weight",
    "attn.wv_dv.weight": "self_attn.v_proj.weight",
    "attn.wr_du.weight": "self_attn.r_proj.weight",
    "attn.wo_ud.weight": "self_attn.o_proj.weight",
    "attn.gate_attn.weight": "self_attn.gate_proj.weight",
    "attn.attn_sink_proj.weight": "self_attn.sink_proj.weight",
    "attn.q_l2_clip.scale": "self_attn.q_l2_clip.scale",
    "attn.rel_l2_clip.scale": "self_attn.rel_l2_clip.scale",
    "attn.rel_logits_proj.proj": "self_attn.rel_logits_proj.proj",
    "attn.k_sconv.weight": "self_attn.k_sconv.conv1d.weight",
    "attn.v_sconv.weight": "self_attn.v_sconv.conv1d.weight",
    "attn.k_sconv.static_w": "self_attn.k_sconv.static_weight",
    "attn.v_sconv.static_w": "self_attn.v_sconv.static_weight",
    "attn.k_sconv.weight_proj": "self_attn.k_sconv.weight_proj.weight",
    "attn.v_sconv.weight_proj": "self_attn.v_sconv.weight_proj.weight",
    "attn_sconv.weight": "post_attention_convolution.conv1d.weight",
    "mlp_sconv.weight": "post_mlp_convolution.conv1d.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "q_input_norm.weight": "q_input_layernorm.weight",
    "k_input_norm.weight": "k_input_layernorm.weight",
    "v_input_norm.weight": "v_input_layernorm.weight",
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.gate.bias": "mlp.gate.e_score_correction_bias",
    "mlp.experts.w13_weight": "mlp.experts.gate_up_proj",
    "mlp.experts.w2_weight": "mlp.experts.down_proj",
}
_ORIGINAL_TOP = {
    "model.llm.unembed.weight": "lm_head.weight",
    "model.llm.embed.weight": "model.embed_tokens.weight",
    "model.llm.embed_norm.weight": "model.embed_tokens.embed_norm.weight",
    "model.llm.norm.weight": "model.norm.weight",
    "model.llm.attn_res.output_query": "model.final_input.query",
}

# Roles of the tensors that make up one expert weight.
DATA, SCALES, GLOBAL_SCALE, IGNORED = "data", "scales", "global_scale", None
# Sidecars of a quantized expert weight, by the suffix on the weight's name: ModelOpt (`_scale`,
# `_scale_2`), Inkling v1 releases (`.scale`, `.scale2`, `.input_amax`, `.original_shape`) and
# transformers' fp8 layout (`_scale_inv`). Activation scales (`w13_input_scale`) serve W4A4 kernels only.
_EXPERT_WEIGHT = re.compile(r"(.*\.mlp\.experts\.(?:w13_weight|w2_weight|gate_up_proj|down_proj))(.*)")
_SIDECARS = {
    "": DATA,
    "_scale": SCALES,
    ".scale": SCALES,
    "_scale_inv": SCALES,
    "_scale_2": GLOBAL_SCALE,
    ".scale2": GLOBAL_SCALE,
    ".input_amax": IGNORED,
    ".original_shape": IGNORED,
}
_ACTIVATION_SCALE = re.compile(r".*\.mlp\.experts\.w(13|2)_input_scale")


def _original_to_transformers(name: str) -> str | None:
    if name in _ORIGINAL_TOP:
        return _ORIGINAL_TOP[name]
    if m := re.fullmatch(r"model\.llm\.attn_res\.attn_queries\.(\d+)", name):
        return f"model.layers.{int(m.group(1)) + 1}.attention_input.query"
    if m := re.fullmatch(r"model\.llm\.attn_res\.mlp_queries\.(\d+)", name):
        return f"model.layers.{m.group(1)}.mlp_input.query"
    if (m := re.fullmatch(r"model\.llm\.layers\.(\d+)\.(.+)", name)) and m.group(2) in _ORIGINAL_LAYER:
        return f"model.layers.{m.group(1)}.{_ORIGINAL_LAYER[m.group(2)]}"
    return None


# The image tower's names, (original, transformers inside `model.vision_tower.`), each {field} one of _NAME_FIELDS.
_VISION_NAMES = (
    ("backbone.embeddings.position_embedding", "embeddings.position_embedding.weight"),
    ("backbone.embeddings.{embedding}", "embeddings.{embedding}"),
    ("backbone.ln_pre.{p}", "pre_layernorm.{p}"),
    ("backbone.layers.{i}.ln_1.{p}", "layers.{i}.layernorm_before.{p}"),
    ("backbone.layers.{i}.ln_2.{p}", "layers.{i}.layernorm_after.{p}"),
    ("backbone.layers.{i}.mlp.c_fc.{p}", "layers.{i}.mlp.fc1.{p}"),
    ("backbone.layers.{i}.mlp.c_proj.{p}", "layers.{i}.mlp.fc2.{p}"),
    ("backbone.layers.{i}.ls_1.gamma", "layers.{i}.lambda_1"),
    ("backbone.layers.{i}.ls_2.gamma", "layers.{i}.lambda_2"),
    ("backbone.layers.{i}.self_attn.{projection}", "layers.{i}.self_attn.{projection}"),
    ("proj_in.{p}", "merger.linear_1.{p}"),
    ("proj_out.{p}", "merger.linear_2.{p}"),
)
_NAME_FIELDS = {
    "i": r"\d+",
    "p": r"weight|bias",
    "embedding": r"patch_embedding\.weight|class_embedding|cls_position_embedding",
    "projection": r"(?:q|k|v|out)_proj\.(?:weight|bias)",
}


def _name_pattern(template: str) -> re.Pattern:
    """A name template as a regex whose named groups are its fields."""
    pieces = re.split(r"\{(\w+)\}", template)  # literal, field, literal, ...
    parts = (re.escape(x) if i % 2 == 0 else f"(?P<{x}>{_NAME_FIELDS[x]})" for i, x in enumerate(pieces))
    return re.compile("".join(parts))


_VISION_PATTERNS = tuple(tuple(_name_pattern(t) for t in pair) for pair in _VISION_NAMES)


def _renamed(name: str, source: int, target: int) -> str | None:
    """A tower name in the layout of column `source` of `_VISION_NAMES` renamed to column `target`'s; None if no
    template matches."""
    for patterns, templates in zip(_VISION_PATTERNS, _VISION_NAMES, strict=True):
        if m := patterns[source].fullmatch(name):
            return templates[target].format(**m.groupdict())
    return None


def vision_path(name: str, layout: str) -> str | None:
    """Our parameter path (`vision_tower.*`) of an image-tower tensor, or None if the name is no tower tensor."""
    if layout == ORIGINAL and name.startswith("model.visual."):
        inner = _renamed(name.removeprefix("model.visual."), 0, 1)
    elif layout == TRANSFORMERS and name.startswith("model.vision_tower."):
        inner = name.removeprefix("model.vision_tower.")
    else:
        inner = None
    return None if inner is None else VISION_PATH + inner


def vision_checkpoint_name(path: str, layout: str) -> str:
    """The checkpoint name, in `layout`, of one of the tower's parameter paths (`vision_tower.*`)."""
    inner = path.removeprefix(VISION_PATH)
    if layout == TRANSFORMERS:
        return "model.vision_tower." + inner
    original = _renamed(inner, 1, 0)
    if original is None:
        raise KeyError(path)
    return "model.visual." + original


_TRANSFORMERS_LAYER = {target: source for source, target in _ORIGINAL_LAYER.items()}
_TRANSFORMERS_TOP = {target: source for source, target in _ORIGINAL_TOP.items()}


def original_name(path: str) -> str:
    """The original-layout checkpoint name of one of our parameter paths (plain weights)."""
    if is_draft(path):
        return path
    if path.startswith(VISION_PATH):
        return vision_checkpoint_name(path, ORIGINAL)
    if path in _TRANSFORMERS_TOP:
        return _TRANSFORMERS_TOP[path]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", path)
    if m is None:
        raise KeyError(path)
    layer, rest = int(m.group(1)), m.group(2)
    if rest == "attention_input.query":
        return f"model.llm.attn_res.attn_queries.{layer - 1}"
    if rest == "mlp_input.query":
        return f"model.llm.attn_res.mlp_queries.{layer}"
    return f"model.llm.layers.{layer}.{_TRANSFORMERS_LAYER[rest]}"


def interleave_rows(gate_up: np.ndarray) -> np.ndarray:
    """Inverse of `deinterleave_rows`: gate rows then up rows -> (gate_0, up_0, gate_1, up_1, ...)."""
    experts, rows, width = gate_up.shape
    return gate_up.reshape(experts, 2, rows // 2, width).transpose(0, 2, 1, 3).reshape(experts, rows, width)


def detect_layout(names: Iterable[str]) -> str:
    """ "original" when the checkpoint uses `model.llm.*` names, else "transformers"."""
    return ORIGINAL if any(name.startswith("model.llm.") for name in names) else TRANSFORMERS


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def is_vision_path(path: str) -> bool:
    """One of our parameter paths in the image tower."""
    return path.startswith(VISION_PATH)


def is_draft(name: str) -> bool:
    """A DSpark draft tensor (the same name in every layout)."""
    return name.startswith(DRAFT_PREFIX)


def is_ignored(name: str) -> bool:
    """Tensors transformers' conversion renames but its model has no parameter for: the key L2 clip
    has a fixed threshold, so a stored `k_l2_clip` tensor does not take part in the reference's math."""
    return ".k_l2_clip." in name


class Mapped(NamedTuple):
    """Where a checkpoint tensor goes: the transformers-named weight, its role, and the transform."""

    target: str
    role: str | None
    transform: Transform


def text_parameter(name: str, layout: str) -> Mapped | None:
    """Where a checkpoint tensor goes, or None if it is no text-model, draft or image-tower tensor.

    Plain weights have role DATA and target our parameter path; a quantized expert weight's tensors
    (data, scales, global scale) share the target of the weight they make up.
    """
    if is_draft(name):
        return Mapped(name, DATA, IDENTITY)
    if is_vision(name):
        path = vision_path(name, layout)
        return None if path is None else Mapped(path, DATA, IDENTITY)
    if _ACTIVATION_SCALE.fullmatch(name):
        return Mapped(name, IGNORED, IDENTITY)
    base, role = name, DATA
    if (m := _EXPERT_WEIGHT.fullmatch(name)) and m.group(2) in _SIDECARS:
        base, role = m.group(1), _SIDECARS[m.group(2)]
    if layout == ORIGINAL:
        target = _original_to_transformers(base)
    elif base.startswith("model.language_model."):
        target = "model." + base.removeprefix("model.language_model.")
    else:
        target = base
    if target is None:
        return None
    interleaved = layout == ORIGINAL and base.endswith("mlp.experts.w13_weight") and role in (DATA, SCALES)
    return Mapped(target, role, DEINTERLEAVE if interleaved else IDENTITY)
