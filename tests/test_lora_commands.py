"""A LoRA checkpoint (adapters + a verified reference to its base) through the commands: `export
--adapter` (peft files transformers + peft load), `export` (merged), `generate` (base + adapters
unmerged, lowered: the eager peft model's greedy tokens), `--merge` refused for a whole model."""
import json

import numpy as np
import pytest
import torch

from torch_model.config import get_preset
from torch_model.lora import apply_lora, parse_lora_spec, unwrap
from torch_model.model import GptOssForCausalLM
from formats import checkpoint
from train.cli import main
from formats.lora_checkpoint import LORA_META, base_reference

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CFG = get_preset("tiny").replace(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                 n_experts=4, experts_per_token=2, expert_dim=32, sliding_window=8,
                                 bos_token_id=319, eos_token_id=319)
SPEC = "r=2,alpha=6,targets=all-linear+experts"
PROMPT = "ROMEO: good"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A base checkpoint (random weights, a trained BPE) and a LoRA checkpoint of it with random
    adapters, written as a LoRA run writes them (adapters only, the base referenced)."""
    import jax.numpy as jnp

    from formats.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("lora_commands")
    enc = train_bpe([open(__file__).read()] * 4, CFG.vocab_size)
    torch.manual_seed(0)
    model = GptOssForCausalLM(CFG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    checkpoint.save_checkpoint(root / "base", model.state_dict(), CFG, tokenizer=enc)
    _, _, base_meta = checkpoint.load_checkpoint(root / "base")
    wrapped = apply_lora(model, parse_lora_spec(SPEC)).eval()
    adapters = {}
    with torch.no_grad():
        for name, p in unwrap(wrapped).named_parameters():
            if p.requires_grad:
                p.copy_(0.2 * torch.randn_like(p))
                adapters[name] = jnp.asarray(p.numpy())
    writer = checkpoint.CheckpointWriter(root / "lora" / "checkpoints", keep=1)
    writer.save(4, {"params": adapters}, {"model": CFG.to_dict(), LORA_META: {
        "spec": SPEC, "base": base_reference(root / "base", base_meta)}}, tokenizer=enc)
    writer.close()
    return root, wrapped, enc


def test_export_adapter_and_merged_of_a_lora_checkpoint_load_in_transformers(lora_run, capsys):
    root, wrapped, enc = lora_run
    ids = torch.tensor([[CFG.bos_token_id] + enc.encode_ordinary(PROMPT) * 2])
    with torch.no_grad():
        ours = wrapped(ids).double()
    assert main(["export", "--checkpoint", str(root / "base"), "--out", str(root / "hf_base")]) == 0
    assert main(["export", "--checkpoint", str(root / "lora"), "--adapter", "--out", str(root / "adapter"),
                 "--base-model", str(root / "hf_base")]) == 0
    assert main(["export", "--checkpoint", str(root / "lora"), "--out", str(root / "merged")]) == 0
    assert "merged (base + LoRA adapters" in capsys.readouterr().out
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(root / "hf_base") and config["r"] == 2
    load = dict(dtype=torch.float32, attn_implementation="eager", experts_implementation="eager")
    base = transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], **load)
    with torch.no_grad():
        adapted = peft.PeftModel.from_pretrained(base, root / "adapter").eval()(input_ids=ids).logits.double()
        merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged", **load)(input_ids=ids).logits
    for theirs in (adapted, merged.double()):
        assert float((theirs - ours).norm() / ours.norm()) <= 1e-5


def test_export_adapter_reads_the_adapters_only(lora_run, tmp_path):
    """`export --adapter` never reads the base (the meta device holds it): with the base checkpoint
    moved away it writes, tensor for tensor, what peft writes from the whole adapted model."""
    from safetensors.numpy import load_file

    from formats.lora_export import export_adapter

    root, wrapped, _ = lora_run
    export_adapter(wrapped, tmp_path / "with")
    (root / "base").rename(root / "base-moved")
    try:
        assert main(["export", "--checkpoint", str(root / "lora"), "--adapter", "--out", str(tmp_path / "without")]) == 0
    finally:
        (root / "base-moved").rename(root / "base")
    with_base, without = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("with", "without"))
    assert set(with_base) == set(without) and len(without) > 0
    assert all(np.array_equal(with_base[k], without[k]) for k in without)
    assert (tmp_path / "with" / "adapter_config.json").read_text() == (tmp_path / "without" / "adapter_config.json").read_text()
    assert (root / "merged" / "tokenizer.json").is_file()


def test_generate_runs_base_plus_adapters_unmerged_like_eager_peft(lora_run, capsys):
    root, wrapped, enc = lora_run
    prompt = [CFG.bos_token_id] + enc.encode_ordinary(PROMPT)
    ids = list(prompt)
    with torch.no_grad():                                  # eager peft, greedy
        for _ in range(5):
            ids.append(int(wrapped(torch.tensor([ids]))[0, -1].argmax()))
    expected = PROMPT + enc.decode([t for t in ids[len(prompt):] if t != CFG.eos_token_id])
    with torch.no_grad(), wrapped.disable_adapter():       # the adapters change what is generated
        assert int(wrapped(torch.tensor([ids[:-1]]))[0, -1].argmax()) != ids[-1] or \
            int(wrapped(torch.tensor([prompt]))[0, -1].argmax()) != ids[len(prompt)]
    assert main(["generate", "--checkpoint", str(root / "lora"), "--prompt", PROMPT, "--temperature", "0",
                 "--max-tokens", "5", "--kernels", "xla"]) == 0
    assert expected in capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(root / "base"), "--prompt", PROMPT, "--merge"]) == 2
    assert "holds no LoRA adapters" in capsys.readouterr().err


def test_merge_reads_each_block_merged_as_peft_merges(lora_run):
    """`--merge`: the plain model on `meta`, each block read from the base's files merged with the
    adapters (formats/lora_merge.py), equal to peft's merge_and_unload at random blocks of every
    tensor (attention projections, expert stacks); a trained head (modules_to_save) is its copy."""
    import copy

    from formats import mesh_loader
    from formats.lora_inference import open_inference_model
    from formats.lora_merge import MergedWeights

    root, wrapped, _ = lora_run
    model, _, source = open_inference_model(root / "lora", merge=True)
    assert isinstance(source, MergedWeights) and all(p.is_meta for p in model.parameters())
    assert {n for n, _ in model.named_parameters()} == set(GptOssForCausalLM(CFG).state_dict())
    head_spec = parse_lora_spec(SPEC + ",modules_to_save=lm_head")
    state, _, _ = checkpoint.load_checkpoint(root / "base")
    base = GptOssForCausalLM(CFG)
    base.load_state_dict(state)
    with_head = apply_lora(base, head_spec).eval()
    with torch.no_grad():
        for p in unwrap(with_head).parameters():
            if p.requires_grad:
                p.copy_(0.2 * torch.randn_like(p))
    _, _, weights = mesh_loader.open_weights(root / "base")
    rng = np.random.default_rng()
    for peft_model, merged_source in ((wrapped, source), (with_head, MergedWeights(weights, with_head))):
        expected = copy.deepcopy(peft_model).merge_and_unload().state_dict()
        assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.gate_up_proj",
                "model.layers.1.mlp.experts.down_proj"} <= set(merged_source.factors)
        for name, value in expected.items():
            starts = [int(rng.integers(0, n)) for n in value.shape]
            index = tuple(slice(a, int(rng.integers(a + 1, n + 1))) for a, n in zip(starts, value.shape))
            np.testing.assert_allclose(merged_source.read(name, index), value.numpy()[index], rtol=1e-6, atol=1e-7,
                                       err_msg=f"{name} {index}")
    assert set(MergedWeights(weights, with_head).trained) == {"lm_head.weight"}


def test_merge_by_block_of_a_transformers_moe_equals_peft(tmp_path):
    """The same for a transformers family whose expert stacks are [E, out, in] (Qwen3-MoE; peft's
    swapped expert layout), from an in-memory base: every tensor whole equals merge_and_unload."""
    import copy
    from types import SimpleNamespace

    from formats.lora_merge import MergedWeights
    from formats.model_checks import build_model
    from tests.transformers_configs import CONFIGS
    from torch_model.transformers_lm import TransformersSpec

    torch.manual_seed(1)
    model = build_model(TransformersSpec(CONFIGS["qwen3_moe"]().to_dict()))
    state = {n: p.detach().clone().numpy() for n, p in model.state_dict().items()}
    wrapped = apply_lora(model, parse_lora_spec("r=2,alpha=6,targets=all-linear+experts")).eval()
    with torch.no_grad():
        for p in unwrap(wrapped).parameters():
            if p.requires_grad:
                p.copy_(0.2 * torch.randn_like(p))
    base = SimpleNamespace(entries={n: SimpleNamespace(shape=v.shape) for n, v in state.items()},
                           read=lambda name, index=None: state[name][index if index is not None else ...])
    merged = MergedWeights(base, wrapped)
    assert {f[4] for n, f in merged.factors.items() if ".experts." in n} == {"experts_out_in"}
    for name, value in copy.deepcopy(wrapped).merge_and_unload().state_dict().items():
        np.testing.assert_allclose(merged.read(name), value.numpy(), rtol=1e-6, atol=1e-6, err_msg=name)


def test_eval_tasks_scores_base_plus_adapters_like_eager_peft(lora_run, tmp_path, capsys):
    """`eval --tasks` of a LoRA checkpoint: the compiled scorer runs base + adapters unmerged (and
    merged with --merge); each choice's log-likelihood equals the eager peft model's."""
    root, wrapped, enc = lora_run
    examples = [{"context": "ROMEO: good", "choices": ["night", "morrow", "lord"], "gold": 1},
                {"context": "import numpy as", "choices": ["np", "pytest"], "gold": 0}]
    task = tmp_path / "lines.jsonl"
    task.write_text("".join(json.dumps(e) + "\n" for e in examples))
    expected = []
    with torch.no_grad():
        for e in examples:
            context = [CFG.bos_token_id] + enc.encode_ordinary(e["context"])
            for choice in e["choices"]:
                full = [CFG.bos_token_id] + enc.encode_ordinary(e["context"] + " " + choice)
                logprobs = torch.log_softmax(wrapped(torch.tensor([full[:-1]]))[0].double(), -1)
                expected.append(sum(float(logprobs[t - 1, full[t]]) for t in range(len(context), len(full))))
    for extra in ([], ["--merge"]):
        out = tmp_path / f"eval{len(extra)}.json"
        assert main(["eval", "--checkpoint", str(root / "lora"), "--tasks", str(task), "--json", str(out),
                     "--no-progress", *extra]) == 0
        found = [ll for ex in json.loads(out.read_text())["tasks"][0]["per_example"] for ll in ex["logprobs"]]
        assert np.allclose(found, expected, rtol=1e-4, atol=1e-5), (extra, found, expected)
    capsys.readouterr()
