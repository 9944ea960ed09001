"""Inkling 2 Small configuration: HF-style `config.json` parsed into frozen dataclasses.

Accepts both `model_type` spellings that transformers 5.23 registers (`inkling2`, with
`text_config` / `vision_config`, and the text-only `inkling2_text`), every field alias transformers
accepts, and transformers' defaults (which describe the full 594B model). Anything wrong raises
`ConfigError` naming the field; fields we do not use are accepted and logged once at debug level.

The DSpark draft is described by a top-level `dspark_config` object (absent: the checkpoint has no
draft). Its field names follow DeepSpec's DSpark configs (`block_size`, `target_layer_ids`,
`mask_token_id`, `markov_rank`, `num_hidden_layers`, ...). The released Inkling draft config is not
public (research/dspark_attnres.md section 6), so these choices are ours, each one DeepSpec's:
- the draft layers are standard pre-norm Qwen3-style layers (qk-RMSNorm, GQA, RoPE, dense SwiGLU MLP),
  not Inkling layers: DeepSpec's draft is that layer whatever the target, and a relative-bias / short-
  convolution layer has no defined meaning inside a bidirectional block;
- attention dims default to the target's full-attention dims; the hidden size must be the target's
  (the draft reads the target's embedding and writes through its LM head); the MLP width defaults to
  4 x hidden; RoPE theta defaults to 1e6 (Qwen3's);
- `sample_from_anchor` (the anchor slot predicts: gamma slots give gamma drafts) and the RNN sequential
  head (`markov_head_type = "rnn"`) are the only layouts supported; others raise ConfigError.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SLIDING = "hybrid_sliding"
FULL = "hybrid"
LAYER_TYPES = (SLIDING, FULL)


class ConfigError(ValueError):
    """A config.json that cannot describe an Inkling 2 model; the message names the field."""


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The language model. Defaults are the released Inkling 2 Small."""

    vocab_size: int = 201024
    unpadded_vocab_size: int = 200058
    hidden_size: int = 4608
    num_hidden_layers: int = 48
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    swa_num_attention_heads: int = 48
    swa_num_key_value_heads: int = 8
    swa_head_dim: int = 128
    sliding_window_size: int = 1024
    d_rel: int = 16
    rel_extent: int = 1024
    log_scaling_n_floor: int = 128000
    log_scaling_alpha: float = 0.1
    layer_types: tuple[str, ...] | None = None  # None: 5 sliding then 1 full, repeated
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    conv_kernel_size: int = 4
    hidden_act: str = "silu"
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    num_experts_per_tok: int = 8
    route_scale: float = 8.0
    qk_l2_clip_threshold: float = 22.627416997969522
    rel_l2_clip_threshold: float = 8.0
    n_layers_per_attn_res_block: int = 6
    mlp_gate_softcap: float = 4.0
    mlp_up_softcap: float = 25.0
    final_logit_softcapping: float = 30.0
    scoring_func: str = "sigmoid"
    initializer_range: float = 0.02
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = 200006

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def is_block_boundary(self, layer: int) -> bool:
        """Layer whose input closes an attention-residual block and becomes a source."""
        return layer % self.n_layers_per_attn_res_block == 0

    @property
    def num_blocks(self) -> int:
        """Attention-residual blocks (the last one may hold fewer layers)."""
        return -(-self.num_hidden_layers // self.n_layers_per_attn_res_block)

    def attention_dims(self, layer: int) -> tuple[int, int, int]:
        """(query heads, kv heads, head dim) of `layer`."""
        if self.is_sliding(layer):
            return self.swa_num_attention_heads, self.swa_num_key_value_heads, self.swa_head_dim
        return self.num_attention_heads, self.num_key_value_heads, self.head_dim

    def relative_extent(self, layer: int) -> int:
        """Backward distances covered by `layer`'s relative bias (the window on sliding layers)."""
        return self.sliding_window_size if self.is_sliding(layer) else self.rel_extent


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The ViT image tower (kept for the multimodal model; the text stack does not use it)."""

    hidden_size: int = 1024
    intermediate_size: int | None = None
    num_hidden_layers: int = 23
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 20
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    mlp_ratio: float = 4.0
    layer_scale_init_value: float = 0.1
    rope_parameters: dict | None = None
    spatial_merge_size: int = 2
    posemb_grid_size: int = 32
    projection_hidden_dim: int = 4096
    projector_bias: bool = False
    text_hidden_size: int = 4608
    initializer_range: float = 0.02


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """The DSpark speculative draft (`dspark_config`). None defaults are resolved from the target's
    config by `parse_config`; `mask_token_id` and `target_layer_ids` have no default."""

    num_hidden_layers: int = 5
    block_size: int = 7  # gamma: block slots = draft tokens per step (the anchor slot predicts)
    target_layer_ids: tuple[int, ...] | None = None  # target decoder layers whose outputs feed the draft
    mask_token_id: int | None = None  # fills the block's slots after the anchor
    markov_rank: int = 256  # r: width of the RNN head's state and token embedding
    markov_head_type: str = "rnn"
    sample_from_anchor: bool = True
    hidden_size: int | None = None  # must equal the target's
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rope_theta: float = 1e6
    rms_norm_eps: float | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A whole checkpoint's config: the text stack, the image tower for `inkling2`, and the DSpark
    draft when the checkpoint ships one."""

    model_type: str
    text: TextConfig
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    quantization: Mapping[str, Any] | None = None
    draft: DraftConfig | None = None


TEXT_ALIASES = {
    "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts",
    "sconv_kernel_size": "conv_kernel_size",
    "model_max_length": "max_position_embeddings",
    "intermediate_size": "moe_intermediate_size",
    "routed_scaling_factor": "route_scale",
}
VISION_ALIASES = {"native_patch_size": "patch_size", "adapter_merge_size": "spatial_merge_size"}
DRAFT_ALIASES = {"noise_token_id": "mask_token_id", "num_draft_layers": "num_hidden_layers", "rnn_rank": "markov_rank"}
DRAFT_SECTION = "dspark_config"

# Fields transformers' PreTrainedConfig carries on every config; they describe nothing we compute.
_GENERIC_FIELDS = frozenset(
    {
        "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache",
        "tie_word_embeddings", "attention_dropout", "return_dict", "output_hidden_states",
        "output_attentions", "is_encoder_decoder", "chunk_size_feed_forward", "id2label", "label2id",
        "problem_type", "tokenizer_class", "task_specific_params", "name_or_path", "_name_or_path",
        "base_config_key", "default_rope_type", "number_of_conv_states", "model_type",
    }
)  # fmt: skip


def _field(section: str, name: str) -> str:
    """How an error names a field: `text_config.hidden_size`, or `hidden_size` at the top level."""
    return f"{section}.{name}" if section else name


def _check_type(section: str, name: str, value: Any, annotation: Any) -> Any:
    """Value of `annotation`'s type (ints accepted for floats, lists for tuples), else ConfigError."""
    where = _field(section, name)
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    for option in options:
        if option is type(None) and value is None:
            return None
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"config field {where!r} must be a finite number, got {value!r}")
            return float(value)
        if option is str and isinstance(value, str):
            return value
        if option is dict and isinstance(value, dict):
            return value
        if typing.get_origin(option) is tuple and isinstance(value, list | tuple):
            (item,) = {a for a in typing.get_args(option) if a is not Ellipsis}
            return tuple(_check_type(section, f"{name}[{i}]", v, item) for i, v in enumerate(value))
    raise ConfigError(f"config field {where!r} must be of type {annotation}, got {value!r}")


def _build(cls: type, section: str, raw: Mapping[str, Any], aliases: Mapping[str, str]) -> tuple[Any, list]:
    """Instantiate `cls` from `raw`, resolving aliases; returns (instance, unused field names)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    unused = []
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name not in fields:
            unused.append(_field(section, key))
            continue
        value = _check_type(section, name, value, hints[name])
        if name in values and values[name] != value:
            raise ConfigError(
                f"config field {_field(section, key)!r} ({value!r}) contradicts {name!r} ({values[name]!r})"
            )
        values[name] = value
    return cls(**values), unused


def _positive(section: str, config: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if not value > 0:
            raise ConfigError(f"config field {_field(section, name)} must be positive, got {value}")


def _validate_text(text: TextConfig, section: str) -> TextConfig:
    _positive(
        section,
        text,
        (
            "vocab_size", "unpadded_vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "swa_num_attention_heads", "swa_num_key_value_heads",
            "swa_head_dim", "sliding_window_size", "d_rel", "rel_extent", "log_scaling_n_floor",
            "max_position_embeddings", "rms_norm_eps", "conv_kernel_size", "moe_intermediate_size",
            "n_routed_experts", "num_experts_per_tok", "route_scale", "qk_l2_clip_threshold",
            "rel_l2_clip_threshold", "n_layers_per_attn_res_block", "mlp_gate_softcap", "mlp_up_softcap",
            "final_logit_softcapping",
        ),
    )  # fmt: skip
    if text.log_scaling_alpha < 0:
        raise ConfigError(
            f"config field {_field(section, 'log_scaling_alpha')} must be >= 0, got {text.log_scaling_alpha}"
        )
    if text.unpadded_vocab_size > text.vocab_size:
        raise ConfigError(
            f"config field {_field(section, 'unpadded_vocab_size')} ({text.unpadded_vocab_size}) exceeds "
            f"vocab_size ({text.vocab_size})"
        )
    for heads, kv in (
        ("num_attention_heads", "num_key_value_heads"),
        ("swa_num_attention_heads", "swa_num_key_value_heads"),
    ):
        if getattr(text, heads) % getattr(text, kv):
            raise ConfigError(
                f"config field {_field(section, kv)} ({getattr(text, kv)}) must divide "
                f"{_field(section, heads)} ({getattr(text, heads)})"
            )
    if text.num_experts_per_tok > text.n_routed_experts:
        raise ConfigError(
            f"config field {_field(section, 'num_experts_per_tok')} ({text.num_experts_per_tok}) exceeds "
            f"n_routed_experts ({text.n_routed_experts})"
        )
    if text.scoring_func != "sigmoid":
        raise ConfigError(
            f"config field {_field(section, 'scoring_func')} must be 'sigmoid', got {text.scoring_func!r}"
        )
    layer_types = text.layer_types
    if layer_types is None:
        layer_types = tuple(FULL if (i + 1) % 6 == 0 else SLIDING for i in range(text.num_hidden_layers))
    if len(layer_types) != text.num_hidden_layers:
        raise ConfigError(
            f"config field {_field(section, 'layer_types')} has {len(layer_types)} entries, "
            f"num_hidden_layers is {text.num_hidden_layers}"
        )
    for i, kind in enumerate(layer_types):
        if kind not in LAYER_TYPES:
            raise ConfigError(
                f"config field {_field(section, 'layer_types')}[{i}] must be one of {LAYER_TYPES}, got {kind!r}"
            )
    eos = text.eos_token_id
    for token in eos if isinstance(eos, tuple) else (eos,):
        if token is not None and not 0 <= token < text.unpadded_vocab_size:
            raise ConfigError(f"config field {_field(section, 'eos_token_id')} {token} is outside the vocabulary")
    return dataclasses.replace(text, layer_types=layer_types)


def _validate_vision(vision: VisionConfig, section: str) -> VisionConfig:
    _positive(
        section,
        vision,
        ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_channels", "patch_size", "mlp_ratio",
         "layer_norm_eps", "spatial_merge_size", "posemb_grid_size", "projection_hidden_dim", "text_hidden_size"),
    )  # fmt: skip
    if vision.hidden_size % vision.num_attention_heads:
        raise ConfigError(
            f"config field {_field(section, 'num_attention_heads')} ({vision.num_attention_heads}) must divide "
            f"{_field(section, 'hidden_size')} ({vision.hidden_size})"
        )
    rope = vision.rope_parameters or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(
            f"config field {_field(section, 'rope_parameters')}.rope_type must be 'axial', got {rope['rope_type']!r}"
        )
    theta = rope.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise ConfigError(
            f"config field {_field(section, 'rope_parameters')}.rope_theta must be positive, got {theta!r}"
        )
    if vision.intermediate_size is None:
        vision = dataclasses.replace(vision, intermediate_size=int(vision.hidden_size * vision.mlp_ratio))
    return vision


def _validate_draft(draft: DraftConfig, text: TextConfig, section: str) -> DraftConfig:
    """`draft` with its None defaults taken from the target `text`, or ConfigError naming the field."""
    defaults = {
        "hidden_size": text.hidden_size,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "head_dim": text.head_dim,
        "intermediate_size": 4 * text.hidden_size,
        "rms_norm_eps": text.rms_norm_eps,
    }
    draft = dataclasses.replace(
        draft, **{name: value for name, value in defaults.items() if getattr(draft, name) is None}
    )
    _positive(
        section,
        draft,
        (
            "num_hidden_layers",
            "block_size",
            "markov_rank",
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "rope_theta",
            "rms_norm_eps",
        ),
    )
    if draft.markov_head_type != "rnn":
        raise ConfigError(
            f"config field {_field(section, 'markov_head_type')} must be 'rnn' (the only sequential head "
            f"supported), got {draft.markov_head_type!r}"
        )
    if not draft.sample_from_anchor:
        raise ConfigError(
            f"config field {_field(section, 'sample_from_anchor')} must be true: only drafts whose anchor slot "
            "predicts (gamma slots -> gamma drafts) are supported"
        )
    if draft.hidden_size != text.hidden_size:
        raise ConfigError(
            f"config field {_field(section, 'hidden_size')} ({draft.hidden_size}) must equal the target's "
            f"hidden_size ({text.hidden_size}): the draft shares its embedding and LM head"
        )
    if draft.num_attention_heads % draft.num_key_value_heads:
        raise ConfigError(
            f"config field {_field(section, 'num_key_value_heads')} ({draft.num_key_value_heads}) must divide "
            f"{_field(section, 'num_attention_heads')} ({draft.num_attention_heads})"
        )
    layers = draft.target_layer_ids
    if not layers:
        raise ConfigError(f"config field {_field(section, 'target_layer_ids')} is missing or empty")
    if len(set(layers)) != len(layers) or any(not 0 <= i < text.num_hidden_layers for i in layers):
        raise ConfigError(
            f"config field {_field(section, 'target_layer_ids')} {list(layers)} must be distinct target layers "
            f"in 0..{text.num_hidden_layers - 1}"
        )
    if draft.mask_token_id is None:
        raise ConfigError(f"config field {_field(section, 'mask_token_id')} is missing")
    if not 0 <= draft.mask_token_id < text.unpadded_vocab_size:
        raise ConfigError(
            f"config field {_field(section, 'mask_token_id')} {draft.mask_token_id} is outside the vocabulary"
        )
    return draft


def _parse_draft(raw: Mapping[str, Any], text: TextConfig) -> tuple[DraftConfig | None, list[str]]:
    """The `dspark_config` section (None when absent) and its unused field names."""
    if raw.get(DRAFT_SECTION) is None:
        return None, []
    draft, unused = _build(DraftConfig, DRAFT_SECTION, _section(raw, DRAFT_SECTION), DRAFT_ALIASES)
    return _validate_draft(draft, text, DRAFT_SECTION), unused


def _section(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"config field {key!r} must be an object, got {type(value).__name__}")
    return value


def parse_config(raw: Mapping[str, Any]) -> ModelConfig:
    """Parse a config.json dict (`inkling2` or `inkling2_text`)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type is None:
        raise ConfigError("config field 'model_type' is missing (expected 'inkling2' or 'inkling2_text')")
    quantization = raw.get("quantization_config")
    if quantization is not None and not isinstance(quantization, dict):
        raise ConfigError("config field 'quantization_config' must be an object")
    unused: list[str] = []
    if model_type == "inkling2_text":
        text, unused = _build(
            TextConfig,
            "",
            {k: v for k, v in raw.items() if k not in ("quantization_config", DRAFT_SECTION)},
            TEXT_ALIASES,
        )
        text = _validate_text(text, "")
        draft, draft_unused = _parse_draft(raw, text)
        unused += draft_unused
        config = ModelConfig(model_type, text, quantization=quantization, draft=draft)
    elif model_type == "inkling2":
        text_raw = _section(raw, "text_config")
        vision_raw = _section(raw, "vision_config")
        text, text_unused = _build(TextConfig, "text_config", text_raw, TEXT_ALIASES)
        vision, vision_unused = _build(VisionConfig, "vision_config", vision_raw, VISION_ALIASES)
        top_unused = [
            k
            for k in raw
            if k not in {"text_config", "vision_config", "image_token_id", "quantization_config", DRAFT_SECTION}
        ]
        unused = text_unused + vision_unused + top_unused
        image_token_id = _check_type("", "image_token_id", raw.get("image_token_id", 200054), int)
        text = _validate_text(text, "text_config")
        vision = _validate_vision(vision, "vision_config")
        if vision.text_hidden_size != text.hidden_size:
            raise ConfigError(
                f"config field vision_config.text_hidden_size ({vision.text_hidden_size}) must equal "
                f"text_config.hidden_size ({text.hidden_size})"
            )
        if not 0 <= image_token_id < text.vocab_size:
            raise ConfigError(f"config field image_token_id {image_token_id} is outside the vocabulary")
        draft, draft_unused = _parse_draft(raw, text)
        unused += draft_unused
        config = ModelConfig(model_type, text, vision, image_token_id, quantization, draft)
    else:
        raise ConfigError(f"config field 'model_type' is {model_type!r}; expected 'inkling2' or 'inkling2_text'")
    ignored = sorted(name for name in unused if name.rsplit(".", 1)[-1] not in _GENERIC_FIELDS)
    if ignored:
        logger.debug("config fields not used by inkling_jax: %s", ", ".join(ignored))
    return config


def load_config(path: str | Path) -> ModelConfig:
    """Read and parse `config.json` (or the config.json inside a checkpoint directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config file at {path}")
    try:
        raw = json.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error}") from error
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from error
    return parse_config(raw)
