"""Pallas kernels for the three hot operations, each beside the plain-JAX reference that is its
test oracle and the `xla` implementation in the op registry.

Every implementation of an op shares the reference's signature:
  attention(q, k, v, sinks, *, sliding_window, scale) -> out
  linear_cross_entropy(hidden, weight, labels, *, ignore_index) -> (nll, lse)
  moe_experts(x, group_sizes, gate_up, gate_up_bias, down, down_bias, *, alpha, limit) -> y
"""
