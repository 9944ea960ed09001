"""Routed-expert computation of a dropless top-k MoE: the entry point the model calls."""

from pallas_kernels.moe.reference import moe_experts

__all__ = ["moe_experts"]
