"""LoRA adapters out to transformers + peft: our adapter files load onto transformers' GptOss and
give our logits (attention and expert adapters, every in != out so an orientation slip shows),
the merged export equals base + adapter, and a merged MXFP4 export's KL is reported."""
import json

import numpy as np
import pytest
import torch

from formats.hf_export import write_hf_dir
from formats.lora_export import export_adapter, export_merged
from torch_model.config import get_preset
from torch_model.lora import apply_lora, parse_lora_spec
from torch_model.model import GptOssForCausalLM

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

# q: 64 -> 64 but k/v: 64 -> 32; experts gate_up [E, 64, 192], down [E, 96, 64]: in != out for
# every expert tensor; sizes multiples of 32 so MXFP4 applies.
CFG = get_preset("tiny").replace(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                 n_experts=4, experts_per_token=2, expert_dim=96, sliding_window=6)
SPEC = parse_lora_spec("r=4,alpha=8,targets=all-linear+experts")


def lora_model(seed=0):
    """(base state_dict, peft-wrapped model with random A and B) in float32."""
    torch.manual_seed(seed)
    model = GptOssForCausalLM(CFG).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.05 * torch.randn_like(p))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = apply_lora(model, SPEC).eval()
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_" in name:
                p.copy_(0.1 * torch.randn_like(p))
    return base, wrapped


def hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits.double()


def load_transformers(path):
    from parity.hf_parity import quantized_load
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        **quantized_load(path)).eval()


def rel_err(a, b):
    return float((a - b).norm() / b.norm())


def kl(p_logits, q_logits):
    """Mean over positions of KL(p || q), the distributions softmax(logits)."""
    logp, logq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return float((logp.exp() * (logp - logq)).sum(-1).mean())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The base as transformers loads it, our adapter beside it, our eager logits."""
    root = tmp_path_factory.mktemp("lora")
    base, wrapped = lora_model()
    ids = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = wrapped(ids).double()
    write_hf_dir(CFG, ((k, v.numpy()) for k, v in base.items()), root / "base")
    summary = export_adapter(wrapped, root / "adapter", base_model=str(root / "base"))
    return root, base, wrapped, ids, ours, summary


def test_transformers_and_peft_load_our_adapter_and_give_our_logits(exported):
    root, _, _, ids, ours, summary = exported
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == ("LORA", "CAUSAL_LM", 4, 8)
    assert "auto_mapping" not in config and config["base_model_name_or_path"] == str(root / "base")
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert summary["n_adapter_params"] > 0
    base = load_transformers(config["base_model_name_or_path"])
    assert rel_err(hf_logits(base, ids), ours) > 1e-2           # the adapter changes the logits
    model = peft.PeftModel.from_pretrained(base, root / "adapter").eval()
    state = peft.get_peft_model_state_dict(model)
    experts = {k: tuple(v.shape) for k, v in state.items() if ".mlp.experts." in k}
    assert len(experts) == 2 * 2 * 2                             # A, B of gate_up and down, 2 layers
    assert experts["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"] == (4 * 4, 64)
    theirs = hf_logits(model, ids)
    assert rel_err(ours, theirs) <= 1e-5, rel_err(ours, theirs)


def test_adapter_export_refuses_an_existing_directory(exported):
    from formats.errors import UserError
    root, _, wrapped, *_ = exported
    with pytest.raises(UserError, match="not empty"):
        export_adapter(wrapped, root / "adapter")
    assert not [p for p in root.iterdir() if p.name.startswith(".adapter.tmp")]


def test_merged_export_equals_base_plus_adapter_and_mxfp4_kl_is_reported(exported, tmp_path):
    import copy
    root, _, wrapped, ids, ours, _ = exported
    on_base = peft.PeftModel.from_pretrained(load_transformers(root / "base"), root / "adapter").eval()
    unmerged = hf_logits(on_base, ids)
    export_merged(copy.deepcopy(wrapped), CFG, tmp_path / "merged", step=3)
    assert "LoRA merged: r=4" in (tmp_path / "merged" / "README.md").read_text()
    merged = hf_logits(load_transformers(tmp_path / "merged"), ids)
    assert rel_err(merged, unmerged) <= 1e-5, rel_err(merged, unmerged)
    export_merged(copy.deepcopy(wrapped), CFG, tmp_path / "merged_q", dtype="mxfp4")
    quantized = hf_logits(load_transformers(tmp_path / "merged_q"), ids)
    base_logits = hf_logits(load_transformers(root / "base"), ids)
    kl_q, kl_base = kl(unmerged, quantized), kl(unmerged, base_logits)
    print(f"\nmerged MXFP4 vs unmerged: logits KL {kl_q:.3e} nats/token (base without adapter: {kl_base:.3e}); "
          f"rel err {rel_err(quantized, unmerged):.3e}")
    assert np.isfinite(kl_q) and 0 < kl_q < kl_base / 4      # rounding loses part of the change, not most
