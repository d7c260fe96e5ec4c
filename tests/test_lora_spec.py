"""The --lora spec and peft's wrapping of our model: errors that name the problem, adapters where
the spec says, and the wrapped model lowered through torchax equal to eager peft."""
import numpy as np
import pytest
import torch

from torch_model.config import ConfigError, get_preset
from torch_model.lora import apply_lora, parse_lora_spec, swapping_parametrized_tensors
from torch_model.model import GptOssForCausalLM


def test_spec_parses_and_refuses_with_the_reason():
    spec = parse_lora_spec("r=8,alpha=16,dropout=0,targets=all-linear+experts")
    assert (spec.r, spec.scaling, spec.target_modules) == (8, 2.0, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert spec.target_parameters == ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    assert parse_lora_spec(str(spec)) == spec
    assert parse_lora_spec("targets=q_proj+v_proj").target_modules == ("q_proj", "v_proj")
    for bad, message in [("r=0", "r must be"), ("rank=4", "keys r, alpha"), ("alpha=x", "alpha must be a number"),
                         ("dropout=0.1,targets=experts", "cannot apply dropout"), ("targets=lm_head", "no gradient"),
                         ("targets=", "targets is empty")]:
        with pytest.raises(ConfigError, match=message):
            parse_lora_spec(bad)


def test_wrapped_model_lowers_through_torchax_like_eager_peft():
    import jax
    import jax.numpy as jnp

    from jax_bridge import registry
    from jax_bridge.env import get_env
    from jax_bridge.lowering import model_function, params_to_jax

    torch.manual_seed(0)
    model = GptOssForCausalLM(get_preset("tiny").replace(n_layers=2, vocab_size=300))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        base = model(ids).numpy()
    with pytest.raises(ConfigError, match="match no module"):
        apply_lora(GptOssForCausalLM(get_preset("tiny").replace(n_layers=1, vocab_size=300)),
                   parse_lora_spec("targets=w_proj"))
    wrapped = apply_lora(model, parse_lora_spec("r=4,alpha=8,targets=all-linear+experts"))
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert sum(".mlp.experts." in n for n in trainable) == 2 * 2 * 2      # A, B of 2 tensors in 2 layers
    with torch.no_grad():
        assert np.array_equal(wrapped(ids).numpy(), base)                 # B starts at zero
        for name, p in wrapped.named_parameters():
            if ".lora_B." in name:
                torch.nn.init.normal_(p, std=0.05)
        eager = wrapped(ids).numpy()
    assert np.abs(eager - base).max() > 1e-3
    with registry.routed(get_env(), registry.resolve("xla"), platform="cpu"), swapping_parametrized_tensors():
        assert torch.__future__.get_swap_module_params_on_conversion()
        lowered = jax.jit(model_function(wrapped))(params_to_jax(wrapped), jnp.asarray(ids.numpy()))
    assert not torch.__future__.get_swap_module_params_on_conversion()    # scoped to the trace
    assert np.abs(np.asarray(lowered) - eager).max() <= 1e-5 * np.abs(eager).max()


def test_merged_state_dict_gives_the_wrapped_models_logits_and_leaves_it_as_it_was():
    from torch_model.lora import merged_state_dict, unwrap

    torch.manual_seed(1)
    cfg = get_preset("tiny").replace(n_layers=2, vocab_size=300)
    wrapped = apply_lora(GptOssForCausalLM(cfg), parse_lora_spec("r=4,alpha=8,targets=all-linear+experts"))
    with torch.no_grad():
        for p in wrapped.parameters():
            torch.nn.init.normal_(p, std=0.05)
    params = {n: p.detach().clone() for n, p in unwrap(wrapped).named_parameters()}
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        expected = wrapped(ids).numpy()
        plain = GptOssForCausalLM(cfg)
        plain.load_state_dict(merged_state_dict(wrapped, params))
        assert np.abs(plain(ids).numpy() - expected).max() <= 1e-5 * np.abs(expected).max()
        assert np.array_equal(wrapped(ids).numpy(), expected)                   # still adapted, unchanged
