"""The MoE feed-forward: sigmoid router with a selection-only correction bias, softcapped SwiGLU experts.

Under a mesh with a `model` axis (set with `jax.set_mesh`), the experts run expert-parallel: each device
computes only its own E/tp experts for the (replicated) tokens, then the fp32 partial sums are
reduce-scattered over tokens, rounded once, and all-gathered back into the replicated residual stream.
"""

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from inkling_jax.config import TextConfig
from inkling_jax.model.params import normal, param, zeros
from inkling_jax.sharding import MODEL
from pallas_kernels.moe import GpuWeight, TpuWeight, kernel_layout, moe_experts
from pallas_kernels.numerics import materialized, round_to, total
from pallas_kernels.quantized import MXFP8, NVFP4, QuantizedArray, quantize


class Router(nnx.Module):
    """Picks top-k experts by sigmoid score + correction bias; weights are the chosen scores,
    normalised to sum to one and multiplied by route_scale. fp32."""

    def __init__(self, rngs: nnx.Rngs, config: TextConfig):
        self.top_k = config.num_experts_per_tok
        self.route_scale = config.route_scale
        experts, hidden = config.n_routed_experts, config.hidden_size
        self.weight = param(rngs, (experts, hidden), (None, "embed"), jnp.float32, normal(config.initializer_range))
        self.e_score_correction_bias = param(rngs, (experts,), (None,), jnp.float32, zeros)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, H] -> (expert ids [N, k] int32, weights [N, k] fp32)."""
        # a reduction, not a dot: the product is tiny, and as an fp32 gemm of 16 columns cuBLAS gives it two CTAs
        logits = total(x.astype(jnp.float32)[:, None, :] * self.weight[...].astype(jnp.float32)[None])
        # the weights' sum below reads the scores, not their exp; the selection's biased scores come from the same
        # kernel (one kernel less between the router and the experts)
        scores = jax.nn.sigmoid(logits)
        scores, biased = materialized((scores, scores + self.e_score_correction_bias[...]))
        _, experts = jax.lax.top_k(biased, self.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        weights = weights / (total(weights, keepdims=True) + 1e-20)
        return experts.astype(jnp.int32), weights * self.route_scale


class QuantizedWeight(nnx.Module):
    """A block-quantized weight [E, N, K] as parameters: data, scales and (NVFP4) per-expert global scales.

    Initialised by quantizing normal(std) values expert by expert, so a random quantized model is
    realistic in scale and can be built directly on device at full size.
    """

    def __init__(
        self, rngs: nnx.Rngs, shape: tuple[int, int, int], axes: tuple[str, str, str], format: str, std: float
    ):
        self.format = format
        # one expert at a time, so building on device never holds more than one expert in fp32
        keys = jax.random.split(rngs.params(), shape[0])
        q = jax.lax.map(lambda key: quantize(normal(std)(key, shape[1:], jnp.float32), format), keys)
        self.data = nnx.Param(q.data, out_sharding=axes, eager_sharding=False)
        self.scales = nnx.Param(q.scales, out_sharding=axes, eager_sharding=False)
        if format == NVFP4:
            self.global_scale = nnx.Param(q.global_scale, out_sharding=(axes[0], None, None), eager_sharding=False)

    def array(self) -> QuantizedArray:
        global_scale = self.global_scale[...] if self.format == NVFP4 else None
        return QuantizedArray(self.data[...], self.scales[...], global_scale, self.format)


EXPERT_AXES = {"gate_up_proj": ("experts", "expert_mlp", "embed"), "down_proj": ("experts", "embed", "expert_mlp")}


class LaidOutWeight(nnx.Module):
    """An expert weight [E, N, K] in a platform's kernel layout (`pallas_kernels.moe.layouts`), each array split
    over experts as the weight it was made from (after `stacked` leading axes of stacked layers). TPU: K before N
    (NVFP4 codes in planes); GPU: the data as stored, the block scales K before N (gate_up's rows paired for the
    kernel's SwiGLU)."""

    def __init__(self, weight: TpuWeight | GpuWeight, axes: tuple[str, str, str], stacked: int = 0):
        experts, n, k = axes
        lead = (None,) * stacked
        self.format, self.platform = weight.format, "tpu" if isinstance(weight, TpuWeight) else "gpu"
        # gate_up's order for the kernels' SwiGLU: GPU rows paired, TPU (NVFP4) columns in down's K order
        self.paired = weight.paired if self.platform == "gpu" else weight.in_down_order
        if self.platform == "gpu":
            data_axes = axes
        else:
            data_axes = (experts, None, k, n) if weight.format == NVFP4 else (experts, k, n)
        self.data = nnx.Param(weight.data, out_sharding=(*lead, *data_axes), eager_sharding=False)
        if weight.format in (MXFP8, NVFP4):
            self.scales = nnx.Param(weight.scales, out_sharding=(*lead, experts, k, n), eager_sharding=False)
        if weight.format == NVFP4:
            self.global_scale = nnx.Param(
                weight.global_scale, out_sharding=(*lead, experts, None, n), eager_sharding=False
            )

    def array(self) -> TpuWeight | GpuWeight:
        scales = self.scales[...] if self.format in (MXFP8, NVFP4) else None
        global_scale = self.global_scale[...] if self.format == NVFP4 else None
        if self.platform == "tpu":
            return TpuWeight(self.data[...], scales, global_scale, self.format, self.paired)
        return GpuWeight(self.data[...], scales, global_scale, self.format, self.paired)


class Experts(nnx.Module):
    """Stacked expert weights: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I];
    plain arrays in the model dtype, or quantized (`format` "mxfp8" / "nvfp4"); re-laid for the kernels at load."""

    def __init__(self, rngs: nnx.Rngs, config: TextConfig, dtype: jnp.dtype, format: str | None = None):
        experts, hidden, inner = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        std = config.initializer_range
        shapes = {"gate_up_proj": (experts, 2 * inner, hidden), "down_proj": (experts, hidden, inner)}
        for name, shape in shapes.items():
            if format is None:
                setattr(self, name, param(rngs, shape, EXPERT_AXES[name], dtype, normal(std)))
            else:
                setattr(self, name, QuantizedWeight(rngs, shape, EXPERT_AXES[name], format, std))

    def weights(self) -> tuple[jax.Array | QuantizedArray | TpuWeight | GpuWeight, ...]:
        """(gate_up, down) as the MoE op takes them."""
        return tuple(
            w.array() if isinstance(w, QuantizedWeight | LaidOutWeight) else w[...]
            for w in (self.gate_up_proj, self.down_proj)
        )

    def lay_out_for(self, platform: str) -> None:
        """Re-lay both weights for `platform`'s ("tpu" or "gpu") expert kernels (once, at load), where the kernels
        take their shapes and dtype; stacked layers' weights ([blocks, E, N, K]) layer by layer."""
        gate_up, down = self.weights()
        if isinstance(gate_up, TpuWeight | GpuWeight):
            return
        lay_out = kernel_layout(platform, gate_up)
        if lay_out is None:
            return
        lead = gate_up.shape[:-3]
        if lead:
            rows = [lay_out(*(jax.tree.map(lambda a, r=r: a[r], w) for w in (gate_up, down))) for r in range(lead[0])]
            laid = [jax.tree.map(lambda *parts: jnp.stack(parts), *(row[i] for row in rows)) for i in range(2)]
        else:
            laid = lay_out(gate_up, down)
        for name, weight in zip(("gate_up_proj", "down_proj"), laid, strict=True):
            setattr(self, name, LaidOutWeight(weight, EXPERT_AXES[name], len(lead)))


class SparseMoeBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, config: TextConfig, dtype: jnp.dtype, expert_format: str | None = None):
        self.config = config
        self.gate = Router(rngs, config)
        self.experts = Experts(rngs, config, dtype, expert_format)

    def __call__(self, x: jax.Array, layer: jax.Array | None = None, valid: jax.Array | None = None) -> jax.Array:
        """x [B, T, H] -> [B, T, H]. `layer`: the experts hold stacked layers' weights [L, E, ...] (a scan's whole
        stack, read in place by the kernels) and this is layer `layer`'s call. `valid` [B, T]: the real tokens;
        the others (idle slots, padding) visit no expert, so that a step reads only the experts its real tokens
        chose, and their rows of the output are zero."""
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(flat)
        if valid is not None:  # an id past every expert is dropped by every backend
            experts = jnp.where(valid.reshape(-1, 1), experts, self.config.n_routed_experts)
        run = functools.partial(
            moe_experts, gate_cap=self.config.mlp_gate_softcap, up_cap=self.config.mlp_up_softcap, distinct_ids=True
        )  # the router's top-k: each token's ids are distinct
        mesh = jax.sharding.get_abstract_mesh()
        if MODEL in mesh.axis_names and mesh.shape[MODEL] > 1:
            out = expert_parallel(run, mesh, flat, *self.experts.weights(), experts, weights, layer)
        else:
            out = run(flat, *self.experts.weights(), experts, weights, layer=layer)
        return out.reshape(x.shape)


def expert_parallel(run, mesh, x, gate_up, down, experts, weights, layer: jax.Array | None = None) -> jax.Array:
    """`run` (the MoE op) over experts split on the mesh's `model` axis; x [N, H] replicated -> [N, H].

    Tokens are already on every device, so dispatch costs nothing; the combine is a reduce-scatter of
    fp32 partial sums (each token's experts add up in fp32 and round once, as without the mesh) and an
    all-gather in the activation dtype. bench/moe_exchange.py compares it with an all-to-all exchange. With
    `layer`, the weights are stacked layers' [L, E, ...], split on E, and the call is that layer's.
    """
    tp, tokens = mesh.shape[MODEL], x.shape[0]
    padded = -(-tokens // tp) * tp  # the reduce-scatter splits tokens evenly
    stacked = layer is not None

    def local(x, gate_up, down, experts, weights, *layer):  # gate_up, down: this device's experts
        per_device = jax.tree.leaves(gate_up)[0].shape[1 if stacked else 0]
        mine = experts - jax.lax.axis_index(MODEL) * per_device  # ids outside [0, per_device) are dropped
        partial = run(
            x,
            gate_up,
            down,
            mine,
            weights,
            out_dtype=jnp.float32,
            routed_experts=per_device * tp,
            layer=layer[0] if layer else None,
        )
        partial = jnp.pad(partial, ((0, padded - tokens), (0, 0)))
        summed = jax.lax.psum_scatter(partial, MODEL, scatter_dimension=0, tiled=True)
        return jax.lax.all_gather(round_to(summed, x.dtype), MODEL, axis=0, tiled=True)[:tokens]

    experts_on_model = P(None, MODEL) if stacked else P(MODEL)
    layers = (layer,) if stacked else ()  # an operand, not a closure: it is traced outside this shard_map
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(), experts_on_model, experts_on_model, P(), P(), *(P() for _ in layers)),
        out_specs=P(),
        axis_names={MODEL},
        check_vma=False,  # the all-gather's result is replicated; the type check cannot see it
    )(x, gate_up, down, experts, weights, *layers)


def lay_out_experts(model: nnx.Module, platform: str) -> nnx.Module:
    """`model` with every MoE layer's experts in `platform`'s kernel layout (see `Experts.lay_out_for`)."""
    for _, module in nnx.iter_graph(model):
        if isinstance(module, Experts):
            module.lay_out_for(platform)
    return model
