"""Reinforcement learning on verifiable rewards (the `rl` command): rollout batches packed for
the GRPO step (`batch`), rewards (`rewards`), rollouts from the compiled decode loop
(`rollout`). The objective itself is torch_model/policy_gradient.py (oracle) and
jax_bridge/policy_gradient.py (in the step)."""
