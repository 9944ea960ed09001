"""Quantized formats (MXFP8, NVFP4) and the quantized-array pytree experts live in."""
