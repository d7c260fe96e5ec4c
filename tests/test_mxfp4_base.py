"""A model whose experts are a frozen MXFP4 base (torch_model Mxfp4Experts, the `moe_mxfp4` op):
the same logits and LoRA training losses as the model holding the decoded values, eagerly and
through the train step, with each `moe_mxfp4` implementation."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from formats.mxfp4_experts import dequantize_experts, quantize_experts
from helpers import rel_err
from jax_bridge.step import StepConfig, TrainStep
from torch_model.config import ConfigError, get_preset
from torch_model.lora import apply_lora, parse_lora_spec, unwrap
from torch_model.model import GptOssForCausalLM, Mxfp4Experts, has_mxfp4_experts
from torch_model.optim import OptimizerConfig

VOCAB, SEQ, BATCH = 300, 12, 2


def base_pair(seed=0):
    """(a tiny model with MXFP4 experts, the same model with the decoded values as float32
    Experts), each with the same non-zero LoRA adapters on attention."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=2, vocab_size=VOCAB))
    with torch.no_grad():
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.1)
    assert quantize_experts(model) == 2 and has_mxfp4_experts(model)
    decoded = copy.deepcopy(model)
    assert dequantize_experts(decoded) == 2 and not has_mxfp4_experts(decoded)
    pair = []
    for m in (model, decoded):
        wrapped = apply_lora(m, parse_lora_spec("r=4,alpha=8,targets=attention"))
        with torch.no_grad():
            for name, p in wrapped.named_parameters():
                if ".lora_" in name:        # A and B alike in both (peft draws A at random)
                    p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape))
        pair.append(wrapped)
    return pair


def tokens(seed=1):
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def test_eager_logits_equal_the_decoded_base():
    quantized, decoded = base_pair()
    ids = tokens()[:, :-1]
    with torch.no_grad():
        a, b = quantized(ids), decoded(ids)
    assert rel_err(a.numpy(), b.numpy()) < 1e-6          # the same values (matmul layouts differ)
    frozen = [n for n, p in quantized.named_parameters() if "experts" in n]
    assert frozen and not any(p.requires_grad for n, p in quantized.named_parameters() if "experts" in n)
    assert any(isinstance(m, Mxfp4Experts) for m in quantized.modules())


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_lora_losses_on_the_mxfp4_base_equal_the_decoded_base(impl):
    """Three LoRA steps in float32 compute: the MXFP4 base (its stacks uint8 on the device,
    decoded by `moe_mxfp4=impl`) and the decoded float32 base give the same losses within 1e-5,
    and the frozen MXFP4 stacks stay uint8 on the device, unchanged."""
    quantized, decoded = base_pair()
    batches = [tokens(seed).numpy()[None] for seed in (1, 2, 3)]
    losses = {}
    for name, model in (("mxfp4", quantized), ("decoded", decoded)):
        kernels = f"attention=xla,cross_entropy=xla,moe=xla,moe_mxfp4={impl}"
        step = TrainStep(model, OptimizerConfig(), StepConfig(kernels=kernels, compute_dtype="float32"))
        state = step.init_state()
        out = []
        for batch in batches:
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
        losses[name] = out
        if name == "mxfp4":
            assert step.kernels["moe_mxfp4"] == impl
            stacks = {n: a for n, a in step.frozen.items() if n.endswith(("_blocks", "_scales"))}
            assert len(stacks) == 8 and all(a.dtype == np.uint8 for a in stacks.values())
            held = dict(unwrap(quantized).named_parameters())
            assert all(np.array_equal(np.asarray(a), held[n].numpy()) for n, a in stacks.items())
    assert losses["mxfp4"][0] != losses["mxfp4"][-1]               # the adapters trained
    assert rel_err(np.array(losses["mxfp4"]), np.array(losses["decoded"])) < 1e-5, losses


def test_expert_lora_on_an_mxfp4_base_is_refused_by_name():
    model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=1, vocab_size=VOCAB))
    quantize_experts(model)
    with pytest.raises(ConfigError, match="targets=experts on an MXFP4 expert base"):
        apply_lora(model, parse_lora_spec("r=4,alpha=8,targets=attention+experts"))
