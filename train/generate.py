"""Sampling from a trained model through the lowered JAX forward.

The sequence lives in a fixed [batch, window] buffer, so the forward compiles once: with causal
attention the padding after the current position cannot change its logits. (A KV-cached
`lax.while_loop` decoder is the next step; see ROADMAP.)
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from train.errors import UserError


class Sampler:
    def __init__(self, model, *, kernels: str = "xla", window: int | None = None):
        from jax_bridge import registry
        from jax_bridge.env import get_env
        from jax_bridge.lowering import model_function, params_to_jax

        self.cfg = model.cfg
        self.window = window or model.cfg.max_seq_len
        self.params = params_to_jax(model)
        from pallas_kernels.platform import host_platform

        platform = host_platform()
        env, resolved, forward = get_env(), registry.resolve(kernels, platform), model_function(model)

        def next_logits(params, ids, positions):
            with registry.routed(env, resolved, platform=platform), jax.default_matmul_precision("highest"):
                logits = forward(params, ids)
            return jnp.take_along_axis(logits, positions[:, None, None], axis=1)[:, 0]

        self._next_logits = jax.jit(next_logits)

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int = 40, seed: int = 0, stop_token: int | None = None) -> list[list[int]]:
        """Continue each prompt (token ids); returns only the new tokens of each."""
        if any(len(p) == 0 for p in prompts):
            raise UserError("generate: every prompt needs at least one token")
        rng = np.random.default_rng(seed)
        seqs = [list(p) for p in prompts]
        new = [[] for _ in prompts]
        done = [False] * len(prompts)
        for _ in range(max_new_tokens):
            ids = np.zeros((len(seqs), self.window), np.int32)
            pos = np.zeros(len(seqs), np.int32)
            for i, s in enumerate(seqs):
                tail = s[-self.window:]
                ids[i, :len(tail)] = tail
                pos[i] = len(tail) - 1
            logits = np.asarray(self._next_logits(self.params, ids, pos), dtype=np.float64)
            for i in range(len(seqs)):
                if done[i]:
                    continue
                token = sample_token(logits[i], temperature, top_k, rng)
                seqs[i].append(token)
                new[i].append(token)
                done[i] = stop_token is not None and token == stop_token
            if all(done):
                break
        return new


def sample_token(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    if temperature <= 0:
        return int(np.argmax(logits))
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        cutoff = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits < cutoff, -np.inf, logits)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    return int(rng.choice(len(probs), p=probs))


def load_for_generation(checkpoint: str):
    """(model, tokenizer) from a checkpoint directory written by `torchlyra train`."""
    import torch

    from torch_model.model import GptOssForCausalLM
    from train.checkpoint import load_checkpoint, tokenizer_dir
    from train.tokenizer import load_tokenizer

    state, model_cfg, meta = load_checkpoint(checkpoint)
    model = GptOssForCausalLM(model_cfg)
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()})
    tok_dir = tokenizer_dir(checkpoint, meta)
    if tok_dir is None:
        raise UserError(f"checkpoint {checkpoint}: config.json names no tokenizer (field tokenizer.dir)")
    return model, load_tokenizer(tok_dir)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory written by `torchlyra train`")
    parser.add_argument("--prompt", action="append", default=None, help="prompt text (repeat for a batch)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels", default="xla")


def run(args) -> int:
    if args.max_tokens <= 0:
        raise UserError(f"--max-tokens must be > 0, found {args.max_tokens}")
    model, tokenizer = load_for_generation(args.checkpoint)
    from train.tokenizer import bos_id

    bos = bos_id(tokenizer)
    prompts = args.prompt or [""]
    sampler = Sampler(model, kernels=args.kernels)
    outs = sampler.generate([[bos] + tokenizer.encode_ordinary(p) for p in prompts], max_new_tokens=args.max_tokens,
                            temperature=args.temperature, top_k=args.top_k, seed=args.seed, stop_token=bos)
    for prompt, ids in zip(prompts, outs):
        text = tokenizer.decode([t for t in ids if t != bos])
        print(f"--- prompt: {prompt!r}\n{prompt}{text}\n")
    return 0
