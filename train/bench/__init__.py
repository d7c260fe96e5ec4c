"""Benchmarks, one module per benchmark (`kernels`, `step` with its torch peers in `torch_peers`,
`generate`, `data`), the machine description they record (`machine`) and the `bench` command
(`cli`). Nothing here imports JAX at package import: `torch_peers` runs in a torchax-free child."""
