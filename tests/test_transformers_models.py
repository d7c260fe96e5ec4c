"""transformers' own decoders behind the model boundary (torch_model/transformers_lm.py): eager
logits against transformers' `eager` attention, the lowered train step's first losses against
eager transformers + the eager optimizer, and the refusals."""
import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, Gemma2Config, LlamaConfig

from jax_bridge.step import StepConfig, TrainStep
from torch_model import transformers_lm
from torch_model.optim import MuonAdamW, OptimizerConfig
from tests.transformers_configs import CONFIGS, VOCAB

STEPS, ROWS, SEQ = 5, 2, 16


def models(family: str):
    """(ours, transformers' eager model) with the same weights."""
    torch.manual_seed(0)
    ours = transformers_lm.build(CONFIGS[family]())
    reference = AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="eager")
    missing, unexpected = reference.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all(n == "lm_head.weight" for n in missing), (missing, unexpected)
    return ours, reference


def test_shapes_and_names_are_transformers():
    llama, _ = models("llama")
    qwen, _ = models("qwen3")
    assert llama.tied and "lm_head.weight" not in dict(llama.named_parameters())
    assert not qwen.tied and "lm_head.weight" in dict(qwen.named_parameters())
    assert qwen.cfg.head_dim == 24 and qwen.cfg.n_kv_heads == 2
    assert qwen.cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert llama.cfg.layer_types == ("full_attention", "full_attention")


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_eager_logits_equal_transformers_eager_attention(family):
    ours, reference = models(family)
    ids = torch.randint(0, VOCAB, (2, 12))       # longer than Qwen3's window of 5
    with torch.no_grad():
        diff = (ours(ids) - reference(ids).logits).abs().max().item()
    assert diff < 1e-5, diff
    if family == "qwen3":                        # the window is honoured: without it the logits move
        ours.model.layers[1].self_attn.sliding_window = None
        with torch.no_grad():
            assert (ours(ids) - reference(ids).logits).abs().max().item() > 1e-3


def eager_losses(reference, tokens) -> list[float]:
    """transformers' eager model trained by the eager optimizer: the ground truth."""
    optimizer = MuonAdamW(reference, OptimizerConfig())
    losses = []
    for batch in torch.from_numpy(tokens.astype(np.int64))[:, 0]:
        reference.zero_grad()
        logits = reference(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# Both layer layouts and both kernel sets, each family once (the suite's time is counted).
@pytest.mark.parametrize("family,kernels,scan", [
    ("llama", "attention=pallas,cross_entropy=pallas", True), ("qwen3", "xla", False)])
def test_lowered_losses_equal_eager_transformers(family, kernels, scan):
    ours, reference = models(family)
    # One batch, every step: the losses must fall as the model learns it.
    batch = np.random.default_rng(1).integers(0, VOCAB, (1, ROWS, SEQ + 1)).astype(np.int32)
    tokens = np.repeat(batch[None], STEPS, axis=0)
    expected = eager_losses(reference, tokens)
    step = TrainStep(ours, OptimizerConfig(), StepConfig(kernels=kernels, compute_dtype="float32",
                                                         matmul_precision="highest", scan_layers=scan))
    state, losses = step.init_state(), []
    for batch in tokens:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[-1] < losses[0]


def test_refusals_name_what_cannot_run():
    def refused(config) -> str:
        with pytest.raises(transformers_lm.UnsupportedModel) as e:
            transformers_lm.build(config)
        return str(e.value)

    small = dict(vocab_size=64, hidden_size=32, num_attention_heads=2)
    assert "attention_dropout=0.1" in refused(LlamaConfig(**small, intermediate_size=48, num_hidden_layers=1,
                                                          attention_dropout=0.1))
    assert "skeleton" in refused(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2))
    assert "linear head" in refused(Gemma2Config(**small, intermediate_size=48, num_hidden_layers=1, head_dim=16,
                                                 num_key_value_heads=1, attn_logit_softcapping=None,
                                                 final_logit_softcapping=30.0))
    # Gemma 2 caps attention logits: built, then refused by the attention function when it runs.
    model = transformers_lm.build(Gemma2Config(**small, intermediate_size=48, num_hidden_layers=2, head_dim=16,
                                               num_key_value_heads=1, attn_logit_softcapping=None,
                                               final_logit_softcapping=None))
    model.config.attn_logit_softcapping = 50.0
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = 50.0
    with pytest.raises(transformers_lm.UnsupportedModel, match="softcap 50.0"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_a_layer_whose_attention_is_not_routed_is_refused(monkeypatch):
    """By behaviour: a family whose attention module ignores the interface (here: one layer's
    attention replaced by a plain module) is refused, naming the layer."""
    config = CONFIGS["llama"]()
    hf = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="eager")
    transformers_lm.register_interfaces()
    hf.config._attn_implementation = transformers_lm.ATTENTION
    hf.model.layers[1].self_attn.config = copy.deepcopy(hf.config)
    hf.model.layers[1].self_attn.config._attn_implementation = "eager"
    with pytest.raises(transformers_lm.UnsupportedModel, match="layer 1 "):
        transformers_lm.TransformersCausalLM(hf)
