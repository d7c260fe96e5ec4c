"""The probe of a plain module's forward (jax_bridge/module_probe.py) reads what the bridge needs by
structure, never by name: the token embedding, the head the loss can fuse (or why not), the blocks
it can scan (or why not), every SDPA call and whether the attention op takes it, the parameters'
roles and the forward's FLOPs. Bad modules are refused in one line naming the problem. A module
run's LoRA adapters load in peft onto the module itself, and a module a notebook holds trains
through `train_module`."""
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import one_line_error, prepare_play_corpus, rel_err

SPEC = "examples/gpt.py:GPT"
ARGS = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def example(**changes):
    from torch_model.module_lm import instantiate

    torch.manual_seed(0)
    return instantiate(SPEC, {**ARGS, **changes})


def facts_of(module):
    from jax_bridge.module_probe import check_blocks, probe

    return check_blocks(module, probe(module))


class Softcapped(nn.Module):
    """examples/gpt.py's GPT whose logits are soft-capped (as Gemma 2's), and whose attention takes
    a boolean causal mask instead of is_causal: neither the head nor SDPA can be routed."""

    def __init__(self):
        super().__init__()
        self.gpt = example()
        for block in self.gpt.blocks:
            block.attention.forward = self._masked(block.attention)

    @staticmethod
    def _masked(attention):
        def forward(x, cos, sin):
            from gpt import rotate

            b, t, _ = x.shape
            q = attention.wq(x).view(b, t, attention.n_heads, -1).transpose(1, 2)
            k = attention.wk(x).view(b, t, attention.n_kv_heads, -1).transpose(1, 2)
            v = attention.wv(x).view(b, t, attention.n_kv_heads, -1).transpose(1, 2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            return attention.wo(out.transpose(1, 2).reshape(b, t, -1))
        return forward

    def forward(self, tokens):
        return 30.0 * torch.tanh(self.gpt(tokens) / 30.0)


class Residuals(nn.Module):
    """Blocks chained as a loop calls them, but the sum of every block's output is what the head
    reads: standing in for the blocks would change it (caught on the weights)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(96, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, 96, bias=False)

    def forward(self, tokens):
        x, total = self.embed(tokens), 0
        for block in self.blocks:
            x = block(x)
            total = total + x
        return self.head(total)


class WithAuxLoss(nn.Module):
    """examples/gpt.py's GPT returning (logits, a balance-loss-like scalar), as MoE code often does."""

    def __init__(self):
        super().__init__()
        self.gpt = example()

    def forward(self, tokens):
        logits = self.gpt(tokens)
        return logits, logits.float().square().mean()


def test_the_probe_reads_the_examples_facts_by_structure():
    from torch_model.causal_lm import mean_attended

    facts = facts_of(example())
    assert (facts.vocab_size, facts.d_model, facts.output) == (96, 32, "tensor")
    assert (facts.embedding, facts.head, facts.blocks) == ("embed", "head", "blocks")
    assert facts.block_types == ("block0", "block0") and facts.head_reason == facts.blocks_reason == ""
    assert [(a.heads, a.kv_heads, a.head_dim, a.causal, a.unroutable) for a in facts.attention] == [(4, 2, 8, True, "")] * 2
    assert facts.roles["embed.weight"] == "embedding" and facts.roles["head.weight"] == "head"
    assert facts.roles["blocks.1.attention.wq.weight"] == "widens" and facts.roles["blocks.1.mlp.w_down.weight"] == "narrows"
    assert facts.roles["blocks.0.attention.wo.weight"] == "narrows"       # square: found by its place after SDPA
    hidden = 4 * 32 * 2 // 3 // 16 * 16
    matmuls = 2 * (2 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * hidden)) + 2 * 32 * 96   # 2 x weights per token
    assert facts.matmul_flops_per_token == matmuls
    from torch_model.module_lm import ModuleSpec

    record = ModuleSpec(SPEC, ARGS, None, facts, 64)
    assert record.training_flops_per_token(64) == 3 * (matmuls + 2 * 4 * 4 * 8 * mean_attended(64, 0))
    moe = facts_of(example(n_experts=4, top_k=2))
    assert moe.roles["blocks.0.mlp.router.weight"] == "router"
    assert {moe.roles[f"blocks.0.mlp.{w}"] for w in ("w_gate", "w_up", "w_down")} <= {"experts_hidden_first",
                                                                                       "experts_hidden_last"}
    tied = facts_of(example(tie_embeddings=True))
    assert tied.head == "head" and "head.weight" not in tied.roles          # the embedding's weight, once


def test_what_the_bridge_cannot_take_is_found_and_said(monkeypatch):
    import sys

    monkeypatch.syspath_prepend("examples")
    sys.modules.pop("gpt", None)
    facts = facts_of(Softcapped())
    assert facts.head is None and "changes gpt.head's output" in facts.head_reason
    assert [a.unroutable for a in facts.attention] == ["an attn_mask (the op takes causal attention only)"] * 2
    assert facts.report({"attention": "pallas"})[0] == ("attention: 0 of 2 SDPA calls -> attention=pallas; 2 plain "
                                                       "(an attn_mask (the op takes causal attention only))")
    residuals = facts_of(Residuals())
    assert residuals.blocks is None and "uses a block's output besides the next block" in residuals.blocks_reason
    biased = example()
    biased.head = nn.Linear(32, 96)
    assert "has a bias" in facts_of(biased).head_reason
    # A balance loss returned beside the logits is not trained on, and the run's header says so.
    from torch_model.module_lm import ModuleFacts

    with_aux = facts_of(WithAuxLoss())
    assert with_aux.output == "first" and with_aux.unused_outputs == ("item 1 (a scalar)",)
    assert with_aux.report({"attention": "xla"})[-1] == ("outputs: the loss is the logits' cross-entropy alone; not "
                                                         "added to it: item 1 (a scalar)")
    assert ModuleFacts.from_dict(json.loads(json.dumps(with_aux.to_dict()))) == with_aux
    plain = facts_of(example())
    assert plain.unused_outputs == () and len(plain.report()) == 3


def test_a_step_of_what_runs_plain_equals_the_eager_modules_loss(monkeypatch):
    """The soft-capped head's plain loss and the masked SDPA calls (counted, run by torchax's own
    computation) give the module's own loss and gradients in the compiled step."""
    import numpy as np

    from jax_bridge import module_ops
    from jax_bridge.module_probe import wrap
    from jax_bridge.step import StepConfig, TrainStep

    monkeypatch.syspath_prepend("examples")
    module = Softcapped()
    model = wrap(module, max_seq_len=64)
    step = TrainStep(model, step_cfg=StepConfig(kernels="xla"))
    tokens = np.random.default_rng(0).integers(0, 96, (2, 17)).astype(np.int32)
    before = module_ops.ROUTED[f"plain: {model.facts.attention[0].unroutable}"]
    (loss, _), grads = step.grads(step.init_state().params, tokens)
    ids = torch.from_numpy(tokens).long()
    eager = F.cross_entropy(module(ids[:, :-1]).reshape(-1, 96), ids[:, 1:].reshape(-1))
    eager.backward()
    assert float(loss) == pytest.approx(float(eager), rel=1e-6)
    grad = dict(module.named_parameters())["gpt.blocks.1.attention.wq.weight"].grad
    assert rel_err(np.asarray(grads["model.layers.1.attention.wq.weight"]), grad.numpy()) <= 1e-5
    assert module_ops.ROUTED[f"plain: {model.facts.attention[0].unroutable}"] > before


@pytest.mark.parametrize("spec, args, expected", [
    ("examples/nothing.py:GPT", {}, "no file examples/nothing.py"),
    ("examples/gpt.py:Nothing", {}, "has no class or function named Nothing"),
    ("examples/gpt.py", {}, "expected path/to/file.py:NAME or package.module:NAME"),
    ("no_such_package.models:GPT", {}, "importing no_such_package.models failed: ModuleNotFoundError"),
    ("examples/gpt.py:GPT", {"width": 3}, "GPT(**{\"width\": 3}) raised TypeError"),
    ("examples/gpt.py:rotary_tables", {"length": 4, "head_dim": 8}, "returned a tuple, expected a torch.nn.Module"),
])
def test_a_bad_spec_is_one_line(spec, args, expected, capsys):
    err = one_line_error(capsys, ["plan", "--module", spec, "--module-args", json.dumps(args), "--seq-len", "32"])
    assert expected in err, err


def test_a_forward_the_bridge_cannot_run_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.py").write_text(
        "import torch\n"
        "class LastOnly(torch.nn.Module):          # nanoGPT's inference shortcut: the last position only\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed, self.head = torch.nn.Embedding(96, 16), torch.nn.Linear(16, 96)\n"
        "    def forward(self, tokens):\n"
        "        return self.head(self.embed(tokens)[:, -1:])\n"
        "class Ragged(LastOnly):\n"
        "    def forward(self, tokens):\n"
        "        return self.head(self.embed(tokens)) * torch.nonzero(tokens).shape[0]\n")
    err = one_line_error(capsys, ["plan", "--module", f"{tmp_path}/bad.py:LastOnly", "--seq-len", "32"])
    assert "returned logits of shape [2, 1, 96] for tokens [2, 16]; expected [B, T, V]" in err, err
    err = one_line_error(capsys, ["plan", "--module", f"{tmp_path}/bad.py:Ragged", "--seq-len", "32"])
    assert "cannot be lowered through torchax" in err and "nonzero" in err, err


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_play_corpus(tmp_path_factory.mktemp("probe_corpus"))     # 320 ids


def test_a_module_from_python_trains_and_its_commands_take_module(data, tmp_path, capsys):
    """train_module on an instance (AdamW for every parameter); the run records no SPEC, so eval
    asks for --module, and with it reproduces the run's validation loss. A vocabulary smaller
    than the data's is refused naming --module-args."""
    from torch_model.optim import ADAMW, plan_parameters
    from train.cli import main
    from train.run.loop import train_module

    args = {**ARGS, "vocab_size": 320}
    summary = train_module(example(vocab_size=320), data=data, out=str(tmp_path / "run"), steps=2, batch_size=4,
                           seq_len=32, eval_every=2, eval_batches=2, samples=0, optimizer="adamw")
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["model"]["module"]["spec"] is None and record["config"]["optimizer"] == "adamw"
    assert set(plan_parameters(example(), optimizer=ADAMW).values()) == {plan_parameters(example())["embed.weight"]}
    capsys.readouterr()
    err = one_line_error(capsys, ["eval", "--checkpoint", str(tmp_path / "run")])
    assert "name its code with --module" in err
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--module", SPEC, "--module-args",
                 json.dumps(args)]) == 0
    assert f"{summary['val_loss_end']:.4f}" in capsys.readouterr().out
    err = one_line_error(capsys, ["train", "--module", SPEC, "--module-args", json.dumps(ARGS), "--data", data,
                                  "--out", str(tmp_path / "small")])
    assert "data vocabulary (320) is larger than the model's vocab_size (96)" in err and "--module-args" in err


def test_lora_on_a_module_run_loads_in_peft_onto_the_module_with_the_runs_logits(data, tmp_path):
    """--lora on a module run (targets by the module's own names); `export --adapter` keys the
    module's own paths, so PeftModel.from_pretrained(the module with the exported base) gives the
    run's logits, and the merged export loads strictly into the module with the same."""
    import safetensors.torch
    from peft import PeftModel

    from formats.lora_checkpoint import load_lora_model
    from torch_model.lora import unwrap
    from train.cli import main

    args = {**ARGS, "vocab_size": 320}
    common = ["--data", data, "--batch-size", "4", "--seq-len", "32", "--samples", "0", "--eval-every", "2",
              "--eval-batches", "2"]
    assert main(["train", "--module", SPEC, "--module-args", json.dumps(args), *common, "--steps", "2",
                 "--out", str(tmp_path / "base")]) == 0
    assert main(["train", "--init-from", str(tmp_path / "base"), "--lora", "r=4,alpha=8,targets=wq+wv", *common,
                 "--steps", "2", "--lr", "0.1", "--out", str(tmp_path / "lora")]) == 0
    for out, extra in (("base_hf", []), ("adapter", ["--adapter"]), ("merged", [])):
        source = tmp_path / ("base" if out == "base_hf" else "lora")
        assert main(["export", "--checkpoint", str(source), "--out", str(tmp_path / out), *extra]) == 0
    wrapped, _, _ = load_lora_model(tmp_path / "lora")
    tokens = torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = unwrap(wrapped).eval()(tokens)         # peft's layers sit in the model itself
    base = example(vocab_size=320).eval()
    safetensors.torch.load_model(base, str(tmp_path / "base_hf" / "model.safetensors"))
    with torch.no_grad():
        plain = base(tokens)
        theirs = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()(tokens)
        merged = example(vocab_size=320).eval()
        safetensors.torch.load_model(merged, str(tmp_path / "merged" / "model.safetensors"))
        folded = merged(tokens)
    assert rel_err(theirs, ours) <= 1e-5 and rel_err(folded, ours) <= 1e-5
    assert not math.isclose(float((theirs - plain).abs().max()), 0.0)      # the adapters moved it


def test_remat_of_a_module_whose_blocks_run_unrolled_is_one_line(data, tmp_path, capsys):
    """--remat recomputes the layers the bridge runs; x-transformers' blocks (norms, attention or
    feed-forward, residual, each a different module) run unrolled, so it is refused, saying why."""
    args = {"vocab_size": 320, "dim": 256, "depth": 1, "heads": 4, "kv_heads": 2, "max_seq_len": 64}
    err = one_line_error(capsys, ["train", "--module", "examples/x_transformers_gpt.py:gpt", "--module-args",
                                  json.dumps(args), "--data", data, "--remat", "full", "--out", str(tmp_path / "run")])
    assert "--remat full recomputes each layer" in err and "not structurally identical" in err, err
