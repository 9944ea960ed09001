"""Pure-jnp oracle for Inkling's routed experts (dropless, softcapped SwiGLU).

out[n] = sum_j w[n, j] * down_e( capped_swiglu( gate_up_e(x[n]) ) ),  e = experts[n, j],
capped_swiglu(g, u) = softcap(g, gate_cap) * sigmoid(g) * softcap(u, up_cap), in fp32.
Token copies are sorted by expert and run as one grouped matmul per projection. A copy routed to an
id outside [0, E) contributes nothing: under expert parallelism each shard is handed only its own E
experts and drops the rest, and returns fp32 partial sums to be added across shards. Quantized expert
weights are dequantized (fp32, rounded once to the activation dtype) before the matmul; kernels
dequantize block by block instead.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.moe.layouts import GpuWeight, TpuWeight
from pallas_kernels.moe.routing import combine, route
from pallas_kernels.numerics import ragged_dot, round_to
from pallas_kernels.quantized import QuantizedArray

# lhs [M, K] x rhs [E, N, K] -> [M, N]: contract K, group the rows of lhs over rhs's expert axis.
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def softcap(x: jax.Array, cap: float) -> jax.Array:
    return jnp.tanh(x / cap) * cap


def capped_swiglu_f32(gate: jax.Array, up: jax.Array, gate_cap: float, up_cap: float) -> jax.Array:
    """SwiGLU whose linear gate factor and up projection are softcapped, in fp32 (what kernels round themselves)."""
    g, u = gate.astype(jnp.float32), up.astype(jnp.float32)
    return softcap(g, gate_cap) * jax.nn.sigmoid(g) * softcap(u, up_cap)


def capped_swiglu(gate: jax.Array, up: jax.Array, gate_cap: float, up_cap: float) -> jax.Array:
    """`capped_swiglu_f32` cast back to the inputs' dtype."""
    return round_to(capped_swiglu_f32(gate, up, gate_cap, up_cap), gate.dtype)


def moe_experts(
    x: jax.Array,
    gate_up: jax.Array | QuantizedArray | TpuWeight | GpuWeight,
    down: jax.Array | QuantizedArray | TpuWeight | GpuWeight,
    experts: jax.Array,
    weights: jax.Array,
    *,
    gate_cap: float,
    up_cap: float,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Weighted sum of each token's experts, [N, H] accumulated in fp32 and rounded once to `out_dtype`
    (default: x's dtype).

    x [N, H]; gate_up [E, 2I, H] (gate rows then up rows); down [E, H, I], plain or quantized (or laid out for
    a kernel);
    experts [N, k] int32 expert ids (ids outside [0, E) are dropped); weights [N, k] float32 routing weights.
    """
    gate_up, down = (w.checkpoint_layout() if isinstance(w, TpuWeight | GpuWeight) else w for w in (gate_up, down))
    gate_up, down = (w.dequantize(x.dtype) if isinstance(w, QuantizedArray) else w for w in (gate_up, down))
    num_experts, two_i, _ = gate_up.shape
    routing = route(experts, weights, num_experts)
    rows = x[routing.token_of]
    gate_up_out = ragged_dot(rows, round_to(gate_up, x.dtype), routing.group_sizes, _GROUPED)
    hidden = capped_swiglu(gate_up_out[:, : two_i // 2], gate_up_out[:, two_i // 2 :], gate_cap, up_cap)
    out_rows = ragged_dot(hidden, round_to(down, x.dtype), routing.group_sizes, _GROUPED)
    return combine(out_rows, routing, experts.shape[0], x.dtype if out_dtype is None else out_dtype)
