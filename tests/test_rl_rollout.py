"""Rollouts from the compiled decode loop: each sampled token's log-probability under
softmax(z / T) over the whole vocabulary and its entropy, against eager torch and against the
train step's `token_logps` (the sampler-vs-trainer difference: at most 2e-5 in float32 on CPU);
new parameters handed in as arrays reuse the compiled programs; a LoRA policy decodes unmerged."""
import dataclasses

import numpy as np
import pytest
import torch

from jax_bridge.step import StepConfig, TrainStep
from torch_model.lora import apply_lora, parse_lora_spec, unwrap
from torch_model.model import GptOssForCausalLM
from torch_model.policy_gradient import PolicyGradientConfig
from train.generation.generator import Generator
from train.generation.sampling import SamplingConfig
from train.rl.batch import Rollout, pack_rollouts, unpack_tokens

from test_grpo_step import tiny_model

PROMPTS = [[5, 9, 17, 3], [40, 2], [7, 7, 81, 12, 60, 33]]
NEW = 6
BOUND = 2e-5


def eager_logps(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        z = model(ids[:, :-1])[0, len(prompt) - 1:].float() / temperature
    logp = torch.log_softmax(z, -1)
    chosen = logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]
    return chosen.numpy(), (-(logp.exp() * logp).sum(-1)).numpy()


@pytest.fixture(scope="module")
def generator():
    model = tiny_model()
    return model, Generator(model, kernels="xla")


def sampling(temperature, seed=0):
    return SamplingConfig(max_new_tokens=NEW, temperature=temperature, top_k=0, top_p=1.0, seed=seed, logprobs=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_and_entropy_are_the_models_at_that_temperature(generator, temperature):
    model, gen = generator
    out = gen.generate(PROMPTS, sampling(temperature))
    for prompt, tokens, lps, ents in zip(PROMPTS, out.tokens, out.logprobs, out.entropies):
        assert len(tokens) == len(lps) == len(ents) == NEW
        want, want_ent = eager_logps(model, prompt, tokens, temperature)
        assert np.abs(np.array(lps) - want).max() <= BOUND and np.abs(np.array(ents) - want_ent).max() <= BOUND


def test_sampler_matches_trainer_and_new_params_need_no_recompile(generator):
    """The step's fused cross-entropy log-probabilities of the sampled tokens equal the sampler's
    (no top-k/top-p: like with like; temperature 1, then 0.7 on both sides); after set_params the
    same programs decode the new policy."""
    model, gen = generator
    step = TrainStep(model, step_cfg=StepConfig(kernels="xla", compute_dtype="float32",
                                                policy_gradient=PolicyGradientConfig(max_new_tokens=NEW)))
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    compiled, diffs = [], []
    for round_ in range(2):
        out = gen.generate(PROMPTS, sampling(1.0, seed=round_))
        compiled.append(len(gen.decoder.compilations))
        rs = [Rollout(p, t) for p, t in zip(PROMPTS, out.tokens)]
        trainer = unpack_tokens(np.asarray(step.token_logps(step.layer_layout.stack(params),
                                                             pack_rollouts(rs, 2, 24))), rs, 24)
        diffs.append(max(float(np.abs(np.array(s) - t).max()) for s, t in zip(out.logprobs, trainer)))
        rng = np.random.default_rng(round_)
        params = {n: v + rng.normal(0, 0.05, v.shape).astype(np.float32) for n, v in params.items()}
        gen.set_params(params)
    # At another temperature both sides take softmax(z / T): the step scales its hidden state.
    hot = TrainStep(model, step_cfg=StepConfig(kernels="xla", compute_dtype="float32", policy_gradient=
                                               PolicyGradientConfig(max_new_tokens=NEW, temperature=0.7)))
    out = gen.generate(PROMPTS, sampling(0.7, seed=5))
    rs = [Rollout(p, t) for p, t in zip(PROMPTS, out.tokens)]
    trainer = unpack_tokens(np.asarray(hot.token_logps(hot.layer_layout.stack(params), pack_rollouts(rs, 2, 24))),
                            rs, 24)
    diffs.append(max(float(np.abs(np.array(s) - t).max()) for s, t in zip(out.logprobs, trainer)))
    assert max(diffs) <= BOUND, diffs
    assert compiled[1] == compiled[0] >= 2, compiled            # prefill + decode, compiled once
    print("sampler-vs-trainer max |logp difference|:", diffs)
    with pytest.raises(ValueError, match="missing"):
        gen.set_params({k: v for k, v in list(params.items())[1:]})


def test_lora_policy_decodes_unmerged():
    model = tiny_model()
    wrapped = apply_lora(model, parse_lora_spec("r=2,alpha=4,targets=all-linear"))
    with torch.no_grad():
        for n, p in wrapped.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    gen = Generator(unwrap(wrapped), kernels="xla")
    assert any("lora_B" in n for n in gen.decoder.params)
    out = gen.generate(PROMPTS, sampling(1.0))
    for prompt, tokens, lps in zip(PROMPTS, out.tokens, out.logprobs):
        want, _ = eager_logps(wrapped, prompt, tokens, 1.0)
        assert np.abs(np.array(lps) - want).max() <= BOUND


def test_decode_collectives_are_read_from_the_compiled_loop(generator):
    """Without a mesh the decode loop moves nothing between devices (under fsdp the rl command
    reports the all-gathers per rollout and per token from the same reading)."""
    _, gen = generator
    gen.generate(PROMPTS, sampling(1.0))
    moved = gen.decoder.decode_collectives()
    assert moved and all(m == {"gathered_per_call": 0, "gathered_per_token": 0, "other_per_token": 0}
                         for m in moved.values())
