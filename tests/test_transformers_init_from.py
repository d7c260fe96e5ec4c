"""A released-style transformers directory of another family than gpt-oss (formats/transformers_import.py):
a Qwen3-MoE saved by transformers' own `save_pretrained` (its experts one tensor per expert on disk,
a Qwen-style tokenizer.json) read as `from_pretrained` reads it, streamed or whole, trained from (`--init-from`, whole and
with LoRA), imported, generated from and evaluated; what it cannot read is refused by field."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from helpers import PLAY_LINES, assert_generates_as, one_line_error
from tests.test_hf_tokenizer import hf_tokenizer_dir
from formats.checkpoint import load_checkpoint
from formats.errors import UserError
from train.cli import main
from train.generation.generator import Generator

CONFIG = {"model_type": "qwen3_moe", "vocab_size": 448, "hidden_size": 64, "intermediate_size": 96,
          "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1],
          "output_router_logits": True, "router_aux_loss_coef": 0.01, "max_position_embeddings": 128,
          "tie_word_embeddings": False, "bos_token_id": 445, "eos_token_id": 445}
ARGS = ["--batch-size", "2", "--seq-len", "32", "--samples", "0", "--eval-every", "2", "--eval-batches", "1",
        "--log-every", "1"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """root/hf: the directory (weights drawn at std 0.3 for clear greedy margins); root/data: text
    prepared with its tokenizer."""
    root = tmp_path_factory.mktemp("hf_family")
    hf_tokenizer_dir(root / "hf", "qwen")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(root / "hf")
    texts, val = root / "texts", root / "val"
    texts.mkdir()
    val.mkdir()
    for i in range(3):
        (texts / f"p{i}.txt").write_text("\n\n".join(PLAY_LINES[(i + j) % 4] for j in range(60)))
    (val / "v.txt").write_text("\n\n".join(PLAY_LINES[j % 4] for j in range(30)))
    assert main(["prepare", "--input", str(texts), "--val-input", str(val), "--out", str(root / "data"),
                 "--tokenizer", f"hf:{root / 'hf'}"]) == 0
    return root


def reference(root):
    return AutoModelForCausalLM.from_pretrained(root / "hf", attn_implementation="eager",
                                                experts_implementation="eager").eval()


def test_the_directory_loads_as_transformers_loads_it_and_generates_its_tokens(root):
    assert any(".experts.0.gate_proj." in k for k in load_file(root / "hf" / "model.safetensors"))  # per expert on disk
    state, spec, meta = load_checkpoint(root / "hf", transformers_ok=True)
    theirs = dict(reference(root).named_parameters())
    assert sorted(state) == sorted(theirs) and all(torch.equal(state[k], theirs[k]) for k in theirs)
    assert spec.model_type == "qwen3_moe" and meta["imported_from"]["dtypes"] == ["float32"]
    assert_generates_as(Generator.from_checkpoint(root / "hf"), reference(root), [[445, 40, 41, 42, 43], [445, 60]])


def test_init_from_the_directory_trains_whole_and_with_lora_from_its_loss(root, tmp_path):
    """Both runs start from the directory's model (LoRA's B = 0: the same step-0 loss) and lower it;
    the LoRA run resumes on the directory as its base."""
    start = None
    for out, extra in (("whole", []), ("lora", ["--lora", "r=4,alpha=8"])):
        assert main(["train", "--init-from", str(root / "hf"), "--data", str(root / "data"), "--out",
                     str(tmp_path / out), "--steps", "2", *ARGS, *extra]) == 0
        evals = [r for r in map(json.loads, (tmp_path / out / "metrics.jsonl").read_text().splitlines())
                 if r["kind"] == "eval"]
        start = start or evals[0]["val_loss"]
        assert evals[0]["step"] == 0 and evals[0]["val_loss"] == pytest.approx(start, rel=1e-5), out
        assert evals[-1]["step"] == 2 and evals[-1]["val_loss"] < start, out
    assert main(["train", "--init-from", str(root / "hf"), "--data", str(root / "data"), "--out", str(tmp_path / "lora"),
                 "--steps", "3", "--resume", *ARGS, "--lora", "r=4,alpha=8"]) == 0


def test_import_writes_our_checkpoint_of_the_same_model(root, tmp_path, capsys):
    assert main(["import", "--hf", str(root / "hf"), "--out", str(tmp_path / "ck")]) == 0
    assert "read one tensor at a time" in capsys.readouterr().out      # the fused experts too
    state, spec, _ = load_checkpoint(tmp_path / "ck", transformers_ok=True)
    theirs = dict(reference(root).named_parameters())
    assert spec.config["model_type"] == "qwen3_moe" and all(torch.equal(state[k], theirs[k]) for k in theirs)
    assert_generates_as(Generator.from_checkpoint(tmp_path / "ck"), reference(root), [[445, 40, 41, 42, 43]])


def test_what_the_directory_cannot_be_read_as_is_refused_by_field(root, tmp_path, capsys):
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                                                        "answer": "Hi"}) + "\n")
    # rl renders chat prompts in harmony: a family's own chat template is not read there (prepare --chat reads it).
    assert "chat needs a tokenizer with the harmony special tokens" in one_line_error(
        capsys, ["rl", "--init-from", str(root / "hf"), "--prompts", str(tmp_path / "prompts.jsonl"), "--reward",
                 "exact:answer", "--out", str(tmp_path / "rl"), "--max-prompt-tokens", "32", "--max-new-tokens", "8"])
    for field, value, message in (("quantization_config", {"quant_method": "fp8"}, "quantized weights"),
                                  ("auto_map", {"AutoModelForCausalLM": "x.Y"}, "custom modeling code")):
        bad = tmp_path / field
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**CONFIG, field: value}))
        assert f"field '{field}': {message}" in one_line_error(capsys, ["generate", "--checkpoint", str(bad)])
    short = tmp_path / "short"
    short.mkdir()
    (short / "config.json").write_text((root / "hf" / "config.json").read_text())
    tensors = load_file(root / "hf" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, short / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(UserError, match="missing keys against its config.json: model.norm.weight"):
        load_checkpoint(short, transformers_ok=True)


def test_directories_stream_onto_the_mesh_as_transformers_own_parameters(root, tmp_path, capsys):
    """A Qwen3 (dense: transformers converts nothing of its layout) and the Qwen3-MoE directory
    (one tensor per expert, which transformers fuses into [E, 2I, H] gate-up stacks) are read slice
    by slice into the train state (formats/mesh_loader.py), giving transformers' own
    parameters; a block of a fused stack reads only the bytes it covers."""
    import shutil

    import numpy as np

    from formats import mesh_loader, transformers_import
    from jax_bridge.step import StepConfig, TrainStep
    from torch_model.optim import OptimizerConfig
    from tests.transformers_configs import CONFIGS as FAMILIES

    dense = tmp_path / "qwen3"
    torch.manual_seed(1)
    config = {**FAMILIES["qwen3"]().to_dict(), "vocab_size": CONFIG["vocab_size"], "bos_token_id": 445,
              "eos_token_id": 445}
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(dense)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "hf" / name, dense / name)
    for directory in (dense, root / "hf"):
        spec, weights = transformers_import.open_streamed(directory)
        step = TrainStep(spec.build(), OptimizerConfig(), StepConfig(kernels="xla", scan_layers=True))
        params = mesh_loader.init_state(step, weights).params
        got = step.layer_layout.unstack({k: np.asarray(v) for k, v in params.items()})
        theirs = dict(AutoModelForCausalLM.from_pretrained(directory).named_parameters())
        assert sorted(got) == sorted(theirs), directory
        assert all(np.array_equal(got[k], theirs[k].detach().numpy()) for k in theirs), directory
    # The MoE's last view: a block across the gate/up seam of experts 1-2 reads those bytes only.
    name = "model.layers.0.mlp.experts.gate_up_proj"
    before, block = weights.bytes_requested, (slice(1, 3), slice(20, 40), slice(0, 64))
    assert np.array_equal(weights.read(name, block), theirs[name].detach().numpy()[block])
    assert weights.bytes_requested - before == 2 * 20 * 64 * 4
    assert main(["train", "--init-from", str(dense), "--data", str(root / "data"), "--out", str(tmp_path / "run"),
                 "--steps", "2", *ARGS]) == 0
    out = capsys.readouterr().out
    assert f"--init-from {dense}: tokenizer hf:" in out and f"initialized from {dense}: process 0 read" in out   # streamed
    evals = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    assert evals[0]["step"] == 0 and evals[-1]["val_loss"] < evals[0]["val_loss"]


def test_a_renamed_released_layout_reads_as_from_pretrained_reads_it(tmp_path):
    """Mixtral as released (`block_sparse_moe.experts.E.w1/w2/w3`, renamed and fused by
    transformers' declaration) reads tensor for tensor as `from_pretrained`'s parameters; a
    declaration with an operation the reader does not interpret (a prefix change) is not read."""
    import numpy as np

    from formats import transformers_import
    from formats.transformers_conversion import ConvertedWeights, conversion_rules

    config = AutoConfig.for_model("mixtral", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=3,
                                  num_experts_per_tok=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert any(".block_sparse_moe.experts.2.w3." in k for k in load_file(tmp_path / "model.safetensors"))
    _, weights = transformers_import.open_streamed(tmp_path)
    theirs = dict(AutoModelForCausalLM.from_pretrained(tmp_path).named_parameters())
    assert isinstance(weights, ConvertedWeights) and sorted(weights.entries) == sorted(theirs)
    assert all(np.array_equal(weights.read(n), p.detach().numpy()) for n, p in theirs.items())
    assert conversion_rules("qwen3_5_moe_text") is None
