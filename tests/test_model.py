"""The eager PyTorch model: references against naive loops, presets, configuration errors."""
import math

import numpy as np
import pytest
import torch

from helpers import rel_err
from torch_model import ops
from torch_model.config import PRESETS, ConfigError, get_preset
from torch_model.model import GptOssForCausalLM, MoE


def naive_attention(q, k, v, sinks, window, scale):
    """Loop over batch, head and query: masked softmax with the sink appended as a column."""
    b, hq, t, d = q.shape
    group = hq // k.shape[1]
    out = np.zeros(q.shape)
    for bi in range(b):
        for h in range(hq):
            for i in range(t):
                keys = [j for j in range(t) if j <= i and (window == 0 or j > i - window)]
                s = [float(q[bi, h, i] @ k[bi, h // group, j]) * scale for j in keys] + [float(sinks[h])]
                p = np.exp(np.array(s) - max(s))
                p /= p.sum()
                out[bi, h, i] = sum(p[n] * v[bi, h // group, j].numpy() for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("window,hq,hkv,t", [(0, 4, 2, 9), (3, 4, 4, 11), (20, 2, 1, 7), (1, 2, 2, 5)])
def test_attention_reference_equals_naive_masked_softmax_with_sink(window, hq, hkv, t):
    g = torch.Generator().manual_seed(window + t)
    q, k, v = (torch.randn(2, h, t, 8, generator=g) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g)
    got = ops.attention_reference(q, k, v, sinks, window, 0.35)
    assert rel_err(got, naive_attention(q, k, v, sinks, window, 0.35)) < 1e-6


def test_moe_layer_equals_naive_per_token_loop():
    cfg = get_preset("tiny").replace(d_model=32, expert_dim=16, n_experts=5, experts_per_token=2)
    torch.manual_seed(0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 7, 32)
    got, _ = moe(x)
    flat = x.reshape(-1, 32)
    expected = torch.zeros_like(flat)
    ex = moe.experts
    for t in range(flat.shape[0]):
        logits = flat[t] @ moe.router.weight.T + moe.router.bias
        top, idx = logits.topk(2)
        w = torch.softmax(top, -1)
        for j in range(2):
            e = idx[j]
            gu = flat[t] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
            gate, up = gu[0::2].clamp(max=7.0), gu[1::2].clamp(-7.0, 7.0)
            h = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            expected[t] += w[j] * (h @ ex.down_proj[e] + ex.down_proj_bias[e])
    assert rel_err(got.detach().reshape(-1, 32), expected.detach()) < 1e-6


def test_moe_op_computes_only_each_rows_own_expert_and_has_gradients():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    experts = torch.tensor([[2], [0], [2], [2], [0], [2]])       # expert 1 chosen by no token
    mix = torch.rand(6, 1, generator=g, requires_grad=True)
    weights = [torch.randn(*s, generator=g, requires_grad=True) for s in ((3, 8, 10), (3, 10), (3, 5, 8), (3, 8))]
    y = ops.OPS["moe"](x, experts, mix, *weights, 1.702, 7.0)
    y.sum().backward()
    assert torch.all(weights[0].grad[1] == 0), "an empty expert must receive no gradient"
    assert torch.all(weights[0].grad[0] != 0)
    assert torch.all(mix.grad != 0), "the routing weights must receive gradients"
    with pytest.raises(ValueError, match="group sizes sum to 5"):
        ops.moe_experts_reference(x, torch.tensor([2, 0, 3]), *weights, 1.702, 7.0)


def test_cross_entropy_op_matches_torch_cross_entropy_and_ignores_labels():
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(9, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (9,), generator=g)
    labels[3] = -100
    nll, lse = ops.OPS["cross_entropy"](h, w, labels, -100)
    expected = torch.nn.functional.cross_entropy(h @ w.T, labels, reduction="none", ignore_index=-100)
    assert rel_err(nll, expected) < 1e-6
    assert nll[3] == 0 and lse[3] == 0


def test_preset_parameter_counts():
    for name, cfg in PRESETS.items():
        counts = cfg.param_counts()
        assert counts["active"] <= counts["total"]
    for name in ("tiny", "dense"):
        model = GptOssForCausalLM(get_preset(name))
        assert sum(p.numel() for p in model.parameters()) == get_preset(name).param_counts()["total"]
    assert 5e6 <= get_preset("tiny").param_counts()["total"] <= 20e6
    lyra = get_preset("lyra-small").param_counts()
    assert 1.5e9 < lyra["total"] < 1.7e9 and 0.95e9 < lyra["active"] < 1.15e9
    oss = get_preset("gpt-oss-20b").param_counts()
    assert 20.5e9 < oss["total"] < 21.5e9       # published: 20.9B total, 3.6B active


def test_layers_alternate_sliding_and_full():
    cfg = get_preset("tiny")
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    model = GptOssForCausalLM(cfg)
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows == [cfg.sliding_window, 0, cfg.sliding_window, 0]


def test_loss_includes_router_and_z_losses_when_configured():
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(n_layers=2, router_aux_loss_coef=1e-2, router_z_loss_coef=1e-4,
                                     lm_z_loss_coef=1e-4)
    model = GptOssForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    out = model(ids[:, :-1], ids[:, 1:])
    expected = out["ce"] + 1e-2 * out["router_balance"] + 1e-4 * out["router_z"] + 1e-4 * out["lm_z"]
    assert math.isclose(out["loss"].item(), expected.item(), rel_tol=1e-6)
    # Reported per MoE layer too; the loss takes their mean.
    assert out["router_z_per_layer"].shape == out["router_balance_per_layer"].shape == (2,)
    assert math.isclose(out["router_z_per_layer"].mean().item(), out["router_z"].item(), rel_tol=1e-6)
    assert math.isclose(out["router_balance_per_layer"].mean().item(), out["router_balance"].item(), rel_tol=1e-6)


def test_dense_preset_trains_eagerly():
    torch.manual_seed(0)
    model = GptOssForCausalLM(get_preset("dense").replace(n_layers=1))
    ids = torch.randint(0, 4096, (2, 9))
    out = model(ids[:, :-1], ids[:, 1:])
    out["loss"].backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("changes,field", [
    ({"n_heads": 3, "n_kv_heads": 2}, "n_heads"), ({"head_dim": 7}, "head_dim"),
    ({"experts_per_token": 9}, "experts_per_token"), ({"layer_types": ["sliding_attention"]}, "layer_types"),
    ({"d_model": 0}, "d_model"), ({"bogus": 1}, "bogus")])
def test_invalid_config_names_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        get_preset("tiny").replace(**changes)


def test_unknown_preset_lists_choices():
    with pytest.raises(ConfigError, match="tiny"):
        get_preset("huge")
