"""Pallas kernels for the hot operations, each beside the plain-JAX reference that is its
test oracle and the `xla` implementation in the op registry.

Every implementation of an op meets the op's contract (positional arguments, keywords, return
value, gradients), declared in one place, `jax_bridge/op_contracts.py`, and shown in
docs/kernels.md.
"""
