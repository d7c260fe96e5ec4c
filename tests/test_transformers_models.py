"""transformers' own decoders behind the model boundary (torch_model/transformers_lm.py): eager
logits against transformers' `eager` attention, the lowered train step's first losses against
eager transformers + the eager optimizer, and the refusals."""
import copy
import dataclasses

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, BloomConfig, Gemma2Config, LlamaConfig

from formats.errors import UserError
from jax_bridge.step import StepConfig, TrainStep
from torch_model import transformers_lm
from torch_model.optim import MuonAdamW, OptimizerConfig
from tests.transformers_configs import CONFIGS, VOCAB

STEPS, ROWS, SEQ = 5, 2, 16


def models(family: str):
    """(ours, transformers' eager model) with the same weights."""
    torch.manual_seed(0)
    ours = transformers_lm.build(CONFIGS[family]())
    reference = AutoModelForCausalLM.from_config(CONFIGS[family](), attn_implementation="eager",
                                                 experts_implementation="eager")
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
    moe, _ = models("qwen3_moe")
    assert moe.cfg.layer_types == ("full_attention+experts", "full_attention", "full_attention+experts")
    assert (moe.cfg.n_experts, moe.cfg.experts_per_token, moe.cfg.router_aux_loss_coef) == (4, 2, 0.01)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_eager_logits_equal_transformers_eager_attention(family):
    ours, reference = models(family)
    ids = torch.randint(0, VOCAB, (2, 12))       # longer than Qwen3's window of 5
    with torch.no_grad():
        diff = (ours(ids) - reference(ids).logits).abs().max().item()
    assert diff < 1e-5, diff
    if family == "qwen3":                        # the window is honoured: without it the logits move
        attention = ours.model.layers[1].self_attn
        attention.sliding_window = None
        attention.torchlyra_attention = dataclasses.replace(attention.torchlyra_attention, window=0)
        with torch.no_grad():
            assert (ours(ids) - reference(ids).logits).abs().max().item() > 1e-3


def eager_losses(reference, tokens) -> list[float]:
    """transformers' eager model trained by the eager optimizer: the ground truth (the router
    loss added as transformers' *ForCausalLM adds it)."""
    optimizer = MuonAdamW(reference, OptimizerConfig())
    losses = []
    for batch in torch.from_numpy(tokens.astype(np.int64))[:, 0]:
        reference.zero_grad()
        out = reference(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
        if getattr(out, "aux_loss", None) is not None:
            loss = loss + reference.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# Both layer layouts and both kernel sets, each family once (the suite's time is counted).
@pytest.mark.parametrize("family,kernels,scan", [
    ("llama", "attention=pallas,cross_entropy=pallas", True), ("qwen3", "xla", False),
    ("qwen3_moe", "attention=pallas,cross_entropy=pallas,moe=pallas", True)])
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
    if ours.cfg.is_moe:
        assert metrics["router_balance"] > 0 and np.asarray(metrics["expert_fraction"]).shape == (2, 4)


def test_transformers_gpt_oss_is_our_decoder():
    """transformers' own GptOssForCausalLM (interleaved, transposed experts with biases, sinks,
    sliding layers) through this path gives our decoder's logits and gradients on the same weights."""
    from formats.hf_mapping import build_hf_config, to_hf_state
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM

    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, n_experts=4,
                                     experts_per_token=2, expert_dim=32, vocab_size=VOCAB, sliding_window=4)
    ours = GptOssForCausalLM(cfg)
    ours.reset_parameters(0)
    with torch.no_grad():           # biases and sinks away from their zero init, so they count
        for name, p in ours.named_parameters():
            if "bias" in name or "sinks" in name:
                p.normal_(0, 0.1)
    theirs = transformers_lm.build(build_hf_config(cfg))
    theirs.load_state_dict(to_hf_state(ours.state_dict(), cfg), strict=True)
    assert theirs.cfg.layer_types == ("sliding_attention+experts", "full_attention+experts")
    ids = torch.randint(0, VOCAB, (2, 11))     # longer than the window of 4
    with torch.no_grad():
        assert (ours(ids) - theirs(ids)).abs().max() < 1e-5
    # Cross-entropy only: the router losses are each family's own (transformers' gpt-oss adds none here).
    ours(ids[:, :-1], ids[:, 1:])["ce"].backward()
    theirs(ids[:, :-1], ids[:, 1:])["ce"].backward()
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - grads[name].grad).abs().max() <= 1e-4 * p.grad.abs().max().clamp(min=1e-6), name


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
    with pytest.raises(transformers_lm.UnsupportedModel, match="layer 1 .* does not call the function transformers' "
                                                               "AttentionInterface names"):
        transformers_lm.TransformersCausalLM(hf)


def test_expert_stacks_stored_as_linear_weights_are_read_so_by_muon_and_the_sharding_rules():
    """Qwen3-MoE stores each expert as nn.Linear weights ([E, out, in]); ours and gpt-oss's are
    [E, in, out]. Same names, so the layout comes from the experts module (is_transposed)."""
    from formats.hf_mapping import build_hf_config
    from jax_bridge.sharding import param_axes
    from torch_model.causal_lm import parameter_roles
    from torch_model.config import get_preset
    from torch_model.optim import MUON, ParamPlan, plan_parameters

    moe, reference = models("qwen3_moe")
    roles = parameter_roles(moe)      # gate_up [E, 2I, H], down [E, H, I]: one nn.Linear weight per expert
    assert roles == {"mlp.experts.gate_up_proj": "experts_out_in",
                     "mlp.experts.down_proj": "experts_out_in"} == parameter_roles(reference)
    plan = plan_parameters(moe)
    assert plan["model.layers.0.mlp.experts.gate_up_proj"] == ParamPlan(MUON, in_axis=-1, out_axis=-2)
    assert param_axes("model.layers.stack0.mlp.experts.down_proj", 4, roles) == ("layers", "exp", "embed_moe", "mlp")
    assert param_axes("model.layers.0.mlp.experts.down_proj", 3) == ("exp", "mlp", "embed_moe")   # [E, in, out]
    gpt_oss = transformers_lm.build(build_hf_config(get_preset("tiny").replace(n_layers=2, vocab_size=VOCAB)))
    assert parameter_roles(gpt_oss) == {}


def test_expert_stacks_go_to_the_moe_ops_layout_once_a_step_with_the_same_update():
    """Qwen3-MoE's experts ([E, 2I, H], gate | up halves) in the moe op's layout ([E, H, 2I], gate
    and up interleaved), as routed_experts converts them at every call: the step converts them once
    before its micro-batches (jax_bridge/expert_layout.py) and their gradients back once, and its
    state after two micro-batches is the state of the step that converts at every call. gpt-oss's
    experts are the op's layout already; experts under LoRA are left to routed_experts."""
    import jax

    from formats.hf_mapping import build_hf_config
    from jax_bridge.expert_layout import ExpertLayout
    from torch_model.config import get_preset
    from torch_model.lora import apply_lora, parse_lora_spec, unwrap

    ours, _ = models("qwen3_moe")
    layout = ExpertLayout.of(ours)
    gate_up = np.random.default_rng(0).standard_normal((4, 64, 64)).astype(np.float32)    # [E, 2I, H]
    down = np.random.default_rng(1).standard_normal((4, 64, 32)).astype(np.float32)       # [E, H, I]
    norm, experts = down[0, 0], "model.layers.2.mlp.experts"
    got = layout.to_op({f"{experts}.gate_up_proj": gate_up, f"{experts}.down_proj": down, "model.norm.weight": norm})
    expected = transformers_lm._interleave(torch.from_numpy(gate_up).transpose(1, 2)).numpy()
    assert np.array_equal(got[f"{experts}.gate_up_proj"], expected)
    assert np.array_equal(got[f"{experts}.down_proj"], down.transpose(0, 2, 1))
    assert got["model.norm.weight"] is norm
    stacked = "model.layers.stack0.mlp.experts.gate_up_proj"
    both = np.stack([gate_up, 2 * gate_up])
    assert np.array_equal(layout.from_op(layout.to_op({stacked: both}))[stacked], both)

    # The experts trained, and frozen beside LoRA adapters on the linear layers (converted as inputs).
    tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 1, SEQ + 1)).astype(np.int32)
    beside_lora = apply_lora(models("qwen3_moe")[0], parse_lora_spec("r=2,alpha=4,targets=all-linear"))
    for model in (ours, beside_lora):
        after = []
        for once in (True, False):
            step = TrainStep(model, OptimizerConfig(), StepConfig(kernels="xla", compute_dtype="float32",
                                                                  micro_batches=2))
            assert step.expert_layout is not None
            if not once:
                step.expert_layout = None           # routed_experts converts at every call, as before
            state, _ = step(step.init_state(), tokens)
            after.append(jax.tree.map(np.asarray, state.params))
        assert any("experts" in n for n in after[0]) == (model is ours)
        for name, value in after[0].items():
            np.testing.assert_allclose(value, after[1][name], rtol=1e-5, atol=1e-7, err_msg=name)

    gpt_oss = transformers_lm.build(build_hf_config(get_preset("tiny").replace(n_layers=2, vocab_size=VOCAB)))
    assert ExpertLayout.of(gpt_oss) is None
    on_experts = apply_lora(models("qwen3_moe")[0], parse_lora_spec("r=2,alpha=4,targets=all-linear+experts"))
    assert ExpertLayout.of(unwrap(on_experts)) is None


def test_a_qwen3_moe_step_with_pallas_kernels_compiles_for_v5e():
    """The real TPU compiler (deviceless v5e) takes the whole bf16 train step of a tiny Qwen3-MoE
    with our Mosaic kernels, the fused MoE kernel with SwiGLU's constants among them."""
    import jax
    import jax.numpy as jnp

    from jax_bridge import tpu_compile

    model = transformers_lm.build(CONFIGS["qwen3_moe"]())
    step = TrainStep(model, step_cfg=StepConfig(kernels="attention=pallas,cross_entropy=pallas,moe=pallas",
                                                platform="tpu", scan_layers=True))
    assert step.cfg.compute_dtype == "bfloat16"
    state = step.abstract_state()
    specs = (state, step.compute_copy_spec(state.params), jax.ShapeDtypeStruct((1, 2, 129), jnp.int32),
             jax.ShapeDtypeStruct((), jnp.float32), step.abstract_frozen())
    _, stats = tpu_compile.compile_for(step._step, specs, tpu_compile.device_of("v5e:2x2"), donate_argnums=(0, 1))
    assert {k.name for k in stats.kernels} == {f"{op}_{part}" for op, parts in (
        ("attention", ("fwd", "dq", "dkv")), ("cross_entropy", ("fwd_e", "dw")), ("moe_fused", ("fwd", "dx", "dw")))
        for part in parts}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_packed_rows_equal_each_document_alone_in_eager_transformers(family):
    """Two documents and padding in one row (segment ids, positions restarting, padding as
    segment 0): the lowered cross-entropy is eager transformers' on each document alone. Qwen3's
    window (5) is shorter than the documents, so the window must hold inside a segment too."""
    ours, reference = models(family)
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, VOCAB, n) for n in (8, 6)]
    pad = 3
    row = np.concatenate([*docs, np.zeros(pad, np.int64)])
    segments = np.concatenate([np.full(len(d), i + 1) for i, d in enumerate(docs)] + [np.zeros(pad, np.int64)])
    positions = np.concatenate([np.arange(len(d)) for d in docs] + [np.zeros(pad, np.int64)])
    weights = np.concatenate([[0], (segments[1:] == segments[:-1]) & (segments[1:] > 0)]).astype(np.float32)
    batch = {"tokens": row[None], "segment_ids": segments[None], "positions": positions[None], "weights": weights[None]}
    step = TrainStep(ours, OptimizerConfig(), StepConfig(kernels="xla", compute_dtype="float32",
                                                         matmul_precision="highest", scan_layers=True))
    got = float(step.evaluate(step.init_state().params, {k: v.astype(np.int32) if k != "weights" else v
                                                          for k, v in batch.items()})["ce"])
    with torch.no_grad():
        nll = sum(torch.nn.functional.cross_entropy(reference(torch.from_numpy(d[None, :-1])).logits[0],
                                                    torch.from_numpy(d[1:]), reduction="sum") for d in docs)
    expected = float(nll) / sum(len(d) - 1 for d in docs)
    assert abs(got - expected) <= 1e-5 * expected, (got, expected)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_log_probabilities_rl_and_dpo_train_on_are_transformers_own_per_document(family):
    """What `rl` (GRPO: `token_logps`) and `train --dpo` (`answer_logps`: summed per answer
    segment) read of a model, on a packed row of two documents and padding: each document's
    log-probabilities under transformers' eager model run on it alone (eager; the lowered
    objectives on these families: tests/test_transformers_train.py)."""
    ours, reference = models(family)
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, VOCAB, n) for n in (8, 6)]
    row = torch.from_numpy(np.concatenate([*docs, np.zeros(3, np.int64)]))[None]
    segments = torch.tensor([[1] * 8 + [2] * 6 + [0] * 3])
    positions = torch.tensor([list(range(8)) + list(range(6)) + [0] * 3])
    weights = ((segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)).float()
    args = (row[:, :-1], row[:, 1:], positions[:, :-1], segments[:, :-1], weights)
    with torch.no_grad():
        logps = ours.token_logps(*args)["logps"][0]
        sums = ours.answer_logps(*args, torch.where(weights > 0, segments[:, :-1], 0))["sums"][0]
        theirs = [torch.log_softmax(reference(torch.from_numpy(d[None, :-1])).logits[0].double(), -1).gather(
            1, torch.from_numpy(d[1:, None]))[:, 0] for d in docs]
    np.testing.assert_allclose(logps[weights[0] > 0].numpy(), torch.cat(theirs).numpy(), rtol=1e-5, atol=1e-5)
    assert (logps[weights[0] == 0] == 0).all()
    np.testing.assert_allclose(sums[1:3].numpy(), [float(t.sum()) for t in theirs], rtol=1e-5)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_an_export_is_transformers_own_layout_and_loads_with_our_logits(family, tmp_path):
    """What `torchlyra export` writes for a transformers model (formats/transformers_export.py):
    the tensors save_pretrained writes (Qwen3-MoE's experts one per expert), which from_pretrained
    loads with our logits, in float32 and bfloat16; a tied head stays tied."""
    from formats.model_checks import load_weights
    from formats.transformers_export import write_transformers_dir

    ours, reference = models(family)
    spec = transformers_lm.TransformersSpec(CONFIGS[family]().to_dict())
    params = [(n, p.detach().numpy()) for n, p in ours.named_parameters()]
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        expected = ours(ids)
    reference.save_pretrained(tmp_path / "saved")
    for dtype, bound in (("float32", 1e-5), ("bfloat16", 2e-2)):
        out = tmp_path / dtype
        summary = write_transformers_dir(spec, iter(params), out, n_tensors=len(params), dtype=dtype,
                                         shard_size_bytes=1 << 30)
        assert summary["files"] == ["model.safetensors"]
        with safe_open(out / "model.safetensors", "pt") as ours_file, \
                safe_open(tmp_path / "saved" / "model.safetensors", "pt") as saved_file:
            assert sorted(ours_file.keys()) == sorted(saved_file.keys())
            assert all(ours_file.get_slice(k).get_shape() == saved_file.get_slice(k).get_shape()
                       for k in ours_file.keys())
        loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", experts_implementation="eager")
        assert loaded.dtype == getattr(torch, dtype)
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == ours.tied
        with torch.no_grad():
            got = loaded(ids).logits.float()
        rel = ((got - expected).norm() / expected.norm()).item()
        assert rel <= bound, (dtype, rel)
    again = transformers_lm.build(CONFIGS[family]())             # what the inference commands load
    load_weights(again, {n: torch.from_numpy(v) for n, v in params})
    with torch.no_grad():
        assert torch.equal(again(ids), expected)
    with pytest.raises(UserError, match="mxfp4"):
        write_transformers_dir(spec, iter(params), tmp_path / "q", n_tensors=len(params), dtype="mxfp4",
                               shard_size_bytes=1 << 30)


def test_bf16_compute_keeps_the_router_of_a_transformers_moe_in_float32():
    """The parameters kept float32 under bf16 compute are exactly those of the modules whose
    logits transformers records as router logits (the family's own declaration), and a bf16 step's
    program promotes only the routers' matmuls to float32 (forward, dW, dX: 3 per MoE layer)."""
    import re

    import jax
    import jax.numpy as jnp

    from jax_bridge.step import cast_params
    from torch_model import causal_lm

    ours, _ = models("qwen3_moe")
    router = ours.model._router.target_class
    expected = {f"{prefix}.{name}" for prefix, module in ours.named_modules() if isinstance(module, router)
                for name, _ in module.named_parameters()}
    params = {n: jnp.zeros(p.shape, jnp.float32) for n, p in ours.named_parameters()}
    kept = {n for n, p in cast_params(params, jnp.bfloat16).items() if p.dtype == jnp.float32}
    assert kept == expected and len(expected) == 2
    step = TrainStep(ours, OptimizerConfig(), StepConfig(kernels="xla", compute_dtype="bfloat16"))
    batch = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ + 1)).astype(np.int32)

    def float32_dots(fragments):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(causal_lm, "FLOAT32_PARAMETERS", fragments)
            cast = cast_params(dict(step.init_state().params), jnp.bfloat16)
            grad = jax.grad(lambda p, b: step.loss_and_metrics(p, b[:, :-1], b[:, 1:])[0])
            text = jax.jit(grad).lower(cast, batch).as_text()
        return len(re.findall(r"dot_general.*-> tensor<[0-9x]*xf32>", text))

    assert float32_dots(causal_lm.FLOAT32_PARAMETERS) - float32_dots(()) == 3 * len(expected)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_generation_gives_transformers_own_greedy_tokens_and_logprobs(family):
    """Our compiled prefill and decode loop (a static KV cache that transformers' attention
    modules write through `StaticCache.update`) against transformers' own `generate` with its
    eager attention and dynamic cache: left-padded prompts of two lengths, Qwen3's window (5)
    shorter than the sequence so its ring of slots wraps; the same greedy tokens and each
    token's log-probability within 1e-4."""
    from helpers import assert_generates_as
    from train.generation.generator import Generator

    ours, reference = models(family)
    with torch.no_grad():           # weights far from their tiny init: clear greedy margins
        for p in ours.parameters():
            p.normal_(0, 0.3)
    reference.load_state_dict(ours.state_dict(), strict=False)
    out = assert_generates_as(Generator(ours), reference, [[5, 9, 17, 33, 2, 8, 11], [40, 41]])
    assert len(set(out.tokens[0])) > 2           # not one repeated token: the test can tell models apart


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_parity_against_transformers_eager_attention_and_experts(family):
    """The parity suite on each family (parity/suite.py): the reference set in float32 and every
    non-reference kernel at once in bf16, against transformers' own eager attention and experts
    on the same weights (packed rows as attention masks), the routing of the bf16 run forced as
    the eager run chose and weighted as the family's router weights; and the LoRA rows (`parity
    --lora`: peft's adapters lowered against peft on transformers' eager model)."""
    from parity.lora_parity import run_lora_parity
    from parity.runs import FAST_COMPILE
    from parity.suite import run_parity
    from torch_model.lora import parse_lora_spec

    report = run_parity(transformers_lm.TransformersSpec(CONFIGS[family]().to_dict()), compiler_options=FAST_COMPILE,
                        kernel_sets={"float32": ["xla"],
                                     "bfloat16": ["attention=pallas,cross_entropy=pallas,moe=pallas"]})
    assert report.passed, report.format()
    routed = {r.name for r in report.rows if r.category == "routing"}
    assert ("model.layers.2.mlp.gate" in routed) == (family == "qwen3_moe")
    targets = "all-linear+experts" if family == "qwen3_moe" else "all-linear"
    lora = run_lora_parity(transformers_lm.TransformersSpec(CONFIGS[family]().to_dict()),
                           parse_lora_spec(f"r=2,alpha=4,targets={targets}"), kernel_sets=["xla"],
                           compiler_options=FAST_COMPILE, seq_len=48)
    assert lora.passed and any(".lora_B." in r.name for r in lora.rows if r.category == "grad"), lora.format()


def test_planted_bugs_fail_the_parity_suite_on_a_qwen3_moe():
    """The planted-bug self-test (parity/selftest.py) on a Qwen3-MoE against transformers' eager
    attention and experts: the controls pass; every bug of a part the model has fails the suite
    naming a tensor at fault, in float32, and each kernel bug in bf16 too. The optimizer's AdamW
    eps x100 is within bf16's bounds on this model (no AdamW tensor has gradients near eps: no
    biases or sinks), reported as missed there; bugs of parts it lacks are listed with why."""
    from parity import planted
    from parity.runs import FAST_COMPILE
    from parity.selftest import CONTROL, RANDOM, run_selftest

    result = run_selftest(model_cfg=transformers_lm.TransformersSpec(CONFIGS["qwen3_moe"]().to_dict()),
                          weights=(RANDOM,), compiler_options=FAST_COMPILE)
    table = result.format()
    ran = {(o.bug, o.dtype): o for o in result.outcomes}
    assert not ran[CONTROL, "float32"].caught and not ran[CONTROL, "bfloat16"].caught, table
    kernel_bugs = {b.name for b in planted.CATALOGUE if b.selector}
    assert {bug for bug, dtype in ran if bug != CONTROL} == {"expert_output_x0.9", "experts_swapped",
                                                              "ce_counts_ignored", "muon_lr_x2", "adam_eps_x100"}
    for (bug, dtype), outcome in ran.items():
        if bug != CONTROL and (dtype == "float32" or bug in kernel_bugs):
            assert outcome.ok, table
    assert {name for name, _, _ in result.skipped} == {"sink_grad_x2", "window_off_by_one", "rope_base_wrong",
                                                       "z_loss_sign"}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_lora_adapter_of_each_family_loads_in_peft_with_our_logits(family, tmp_path):
    """Adapters on the transformers model as it is (peft through torch_model.lora; Qwen3-MoE's
    stacked experts too), with random A and B so every orientation slip shows: peft's
    `PeftModel.from_pretrained` on transformers' eager model of the exported base, and the merged
    export in transformers, give our eager logits within 1e-5 (a trained adapter of a Qwen3-MoE
    run: tests/test_transformers_train.py)."""
    import copy

    from peft import PeftModel

    from formats.lora_export import export_adapter, export_merged
    from formats.transformers_export import write_transformers_dir
    from torch_model.lora import apply_lora, parse_lora_spec

    ours, _ = models(family)
    spec = transformers_lm.TransformersSpec(CONFIGS[family]().to_dict())
    params = [(n, p.detach().numpy().copy()) for n, p in ours.named_parameters()]
    write_transformers_dir(spec, iter(params), tmp_path / "base", n_tensors=len(params), shard_size_bytes=1 << 30)
    targets = "all-linear+experts" if ours.cfg.is_moe else "all-linear"
    wrapped = apply_lora(ours, parse_lora_spec(f"r=4,alpha=8,targets={targets}")).eval()
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.1)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        expected = wrapped(ids).double()
    export_adapter(wrapped, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager",
                                                experts_implementation="eager").eval()
    with torch.no_grad():
        plain = base(ids).logits.double()
        theirs = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(ids).logits.double()
    assert ((plain - expected).norm() / expected.norm()).item() > 1e-3        # the adapters change the model
    assert ((theirs - expected).norm() / expected.norm()).item() <= 1e-5
    export_merged(copy.deepcopy(wrapped), spec, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager",
                                                  experts_implementation="eager").eval()
    with torch.no_grad():
        folded = merged(ids).logits.double()
    assert ((folded - expected).norm() / expected.norm()).item() <= 1e-5


def test_a_stack_of_unrepeated_layer_types_scans_group_by_group():
    """Two dense layers, then three MoE ones (as DeepSeek-V3 and GLM-4 MoE begin with dense
    layers): no period repeats, so each run of identical layers is one scan (two scans, not five
    layers unrolled), stored as the "grouped" layout that checkpoints name; the first losses equal
    eager transformers + the eager optimizer, and the checkpoint layout unstacks to the layers."""
    from transformers import Qwen3MoeConfig

    from formats.checkpoint import LAYOUTS
    from jax_bridge.layer_stack import LayerLayout

    def config():
        return Qwen3MoeConfig(**{**CONFIGS["qwen3_moe"]().to_dict(), "num_hidden_layers": 5, "mlp_only_layers": [0, 1]})

    torch.manual_seed(0)
    ours = transformers_lm.build(config())
    reference = AutoModelForCausalLM.from_config(config(), attn_implementation="eager", experts_implementation="eager")
    reference.load_state_dict(ours.state_dict(), strict=False)
    assert LayerLayout.for_config(ours.cfg, True).groups == ((0, 1, 2), (2, 1, 3))
    batch = np.random.default_rng(1).integers(0, VOCAB, (1, ROWS, SEQ + 1)).astype(np.int32)
    tokens = np.repeat(batch[None], STEPS, axis=0)
    expected = eager_losses(reference, tokens)
    step = TrainStep(ours, OptimizerConfig(), StepConfig(kernels="xla", compute_dtype="float32",
                                                         matmul_precision="highest", scan_layers=True))
    assert step.layout == "grouped"
    state, losses = step.init_state(), []
    assert state.params["model.layers.stack1.mlp.experts.gate_up_proj"].shape[0] == 3
    for batch in tokens:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    stored = {k: np.asarray(v) for k, v in state.params.items()}
    per_layer = LAYOUTS[step.layout](stored, ours.cfg)
    assert sorted(per_layer) == sorted(n for n, _ in ours.named_parameters())
    assert np.array_equal(per_layer["model.layers.4.mlp.experts.down_proj"],
                          stored["model.layers.stack1.mlp.experts.down_proj"][2])
