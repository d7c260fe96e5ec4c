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


# ---- `train --init-from RELEASED --lora ... --base-dtype mxfp4` ------------------------------------
@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A released-layout directory (MXFP4 experts, bf16 rest) and a prepared corpus."""
    from helpers import prepare_play_corpus
    from test_mxfp4 import RELEASED, write_released

    from formats.tokenizer import load_tokenizer, save_tokenizer

    root = tmp_path_factory.mktemp("mxfp4_base")
    data = prepare_play_corpus(root)
    write_released(root / "hf", RELEASED, seed=3)
    decisive_head(root / "hf", 30.0)
    save_tokenizer(load_tokenizer(data), root / "hf" / "tiktoken")     # as our exports carry it
    return root, data


def decisive_head(hf_dir, factor: float) -> None:
    """lm_head scaled up: the random model's logits (else nearly uniform, so that rounding noise
    of 1e-7 can flip a greedy choice) get margins far above any difference of summation order."""
    import json

    import safetensors.torch

    weight_map = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shard = hf_dir / weight_map["lm_head.weight"]
    tensors = safetensors.torch.load_file(str(shard))
    tensors["lm_head.weight"] = (tensors["lm_head.weight"].float() * factor).bfloat16()
    safetensors.torch.save_file(tensors, str(shard), metadata={"format": "pt"})


def lora_run(root, data, out, **changes):
    from train.run.config import TrainConfig
    from train.run.loop import run_training

    settings = dict(data=data, out=str(out), init_from=str(root / "hf"), lora="r=4,alpha=8,targets=attention",
                    compute_dtype="float32", kernels="xla", batch_size=2, seq_len=16, steps=3, warmup_steps=1,
                    log_every=1, eval_every=3, eval_batches=1, checkpoint_every=2, samples=0)
    run_training(TrainConfig(**{**settings, **changes}), explicit={k: v for k, v in changes.items()},
                 show_progress=False)
    return out


def run_losses(run_dir) -> list[float]:
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


def test_a_lora_run_on_the_released_mxfp4_base_gives_the_decoded_bases_losses_and_resumes_exactly(released, capsys):
    import json
    import shutil

    from formats.hf_weights import HFWeights
    from formats.mxfp4_experts import released_base
    from formats.hf_model import open_hf

    root, data = released
    cfg, weights = open_hf(root / "hf")
    model = released_base(cfg, weights)                 # the bytes as stored: nothing decoded on the host
    stored = HFWeights(root / "hf", quantized=True)
    blocks, scales = stored.read_packed("model.layers.1.mlp.experts.down_proj")
    held = dict(model.named_parameters())
    assert np.array_equal(held["model.layers.1.mlp.experts.down_proj_blocks"].numpy(), blocks)
    assert np.array_equal(held["model.layers.1.mlp.experts.down_proj_scales"].numpy(), scales)
    assert not any(p.is_floating_point() and p.dim() == 3 and "experts" in n and "bias" not in n for n, p in held.items())

    # With the end of run's samples and periodic task scores, which gather the MXFP4 bytes as they are.
    tasks = root / "plays.jsonl"
    tasks.write_text("".join(json.dumps({"context": f"{who}:", "choices": ["But soft", "O Romeo", "To be"], "gold": i})
                             + "\n" for i, who in enumerate(["ROMEO", "JULIET", "HAMLET"])))
    extras = dict(samples=1, eval_tasks=str(tasks))
    capsys.readouterr()
    mxfp4 = lora_run(root, data, root / "mxfp4", base_dtype="mxfp4", **extras)
    total = sum(e.nbytes for e in stored.entries.values())      # the stored bytes, MXFP4 as packed
    assert f"process 0 read {total:,} of {total:,} stored bytes onto its devices" in capsys.readouterr().out
    decoded = lora_run(root, data, root / "decoded", **extras)
    a, b = run_losses(mxfp4), run_losses(decoded)
    assert len(a) == 3 and len(set(a)) > 1
    assert rel_err(np.array(a), np.array(b)) < 1e-5, (a, b)
    scores = [[r["tasks"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "eval"] for run in (mxfp4, decoded)]
    assert scores[0] == scores[1] and len(scores[0]) == 2
    samples = [json.loads((run / "summary.json").read_text())["samples"] for run in (mxfp4, decoded)]
    assert samples[0] == samples[1] and len(samples[0]) == 1

    resumed = root / "mxfp4_resumed"                    # the same run, stopped after step 2
    shutil.copytree(mxfp4, resumed)
    shutil.rmtree(resumed / "checkpoints" / "3")
    lora_run(root, data, resumed, resume=True)
    assert run_losses(resumed) == a


def test_an_mxfp4_base_is_read_only_from_the_released_layout(released, tmp_path):
    """Our checkpoint (or a transformers directory) is refused, naming why and the way out; so is
    --base-dtype mxfp4 without LoRA."""
    from formats.errors import UserError
    from formats.hf_import import import_hf

    root, data = released
    import_hf(root / "hf", tmp_path / "ck")
    with pytest.raises(UserError, match="not a gpt-oss directory in the released layout.*export --dtype mxfp4"):
        lora_run(root, data, tmp_path / "run", init_from=str(tmp_path / "ck"), base_dtype="mxfp4")
    with pytest.raises(UserError, match="base_dtype mxfp4 .* needs lora"):
        lora_run(root, data, tmp_path / "run2", lora="", base_dtype="mxfp4")


def test_plan_holds_the_mxfp4_base_as_its_bytes_and_compiles_the_mxfp4_kernels_for_tpu():
    """`plan --lora ... --base-dtype mxfp4`: the frozen experts are arguments of 4.25 bits per
    weight (blocks and scale bytes), the rest in bf16, and the TPU compiler compiles the step with
    the `moe_mxfp4` Pallas kernels (forward and dx)."""
    from jax_bridge.plan import plan

    cfg = get_preset("tiny").replace(n_layers=1)
    lora = "r=4,alpha=8,targets=attention"
    common = dict(mesh=None, seq_len=64, batch_size=4, lora=lora, model_overrides={"n_layers": 1}, scan_layers=True)
    quantized = plan("tiny", "v5e:2x2", base_dtype="mxfp4", **common)
    dense = plan("tiny", "v5e:2x2", **common)
    e, h, i = cfg.n_experts, cfg.d_model, cfg.expert_dim
    weights = e * (2 * i * h + i * h)
    assert dense.frozen_bytes - quantized.frozen_bytes == weights * 2 - (weights // 2 + weights // 32)
    assert quantized.fits and quantized.compile_s > 0          # compiled by the TPU compiler, and it fits
    assert quantized.kernels["moe_mxfp4"] == "pallas" and quantized.base_dtype == "mxfp4"
    with pytest.raises(ValueError, match="base_dtype mxfp4 is planned for a gpt-oss LoRA step"):
        plan("tiny", "v5e:2x2", base_dtype="mxfp4", **{**common, "lora": None})


def generated(capsys, checkpoint, *flags) -> str:
    from train.cli import main

    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "ROMEO", "--prompt", "JULIET: O",
                 "--temperature", "0", "--max-tokens", "12", "--no-stream", *flags]) == 0
    return capsys.readouterr().out


def test_the_mxfp4_base_is_read_by_slice_as_stored(released):
    """What the loader places an MXFP4 base from: the model on `meta`, each expert stack's stored
    bytes read by slice (experts, rows, whole blocks) equal to the stored tensor's slice."""
    from formats.hf_weights import HFWeights
    from formats.lora_inference import open_inference_model

    root, _ = released
    model, _, source = open_inference_model(root / "hf", base_dtype="mxfp4")
    assert source is not None and all(p.is_meta for p in model.parameters()) and has_mxfp4_experts(model)
    stored = HFWeights(root / "hf", quantized=True)
    rng = np.random.default_rng()
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        whole = dict(zip(("_blocks", "_scales"), stored.read_packed(name)))
        for suffix, array in whole.items():
            assert source.entries[name + suffix].shape == array.shape
            e0, r0 = (int(rng.integers(0, n)) for n in array.shape[:2])
            per = 16 if suffix == "_blocks" else 1
            c0 = per * int(rng.integers(0, array.shape[2] // per))
            index = (slice(e0, array.shape[0]), slice(r0, r0 + 3), slice(c0, array.shape[2]))
            assert np.array_equal(source.read(name + suffix, index), array[index]), (name, suffix, index)
    with pytest.raises(ValueError, match="whole blocks of 16"):
        source.read("model.layers.0.mlp.experts.down_proj_blocks", (slice(None), slice(None), slice(8, 16)))


def test_generate_on_the_mxfp4_base_gives_the_decoded_bases_greedy_text(released, capsys):
    """`generate --base-dtype mxfp4` on the released directory and on a LoRA checkpoint trained on
    it: the experts' bytes on the device (placed by slice), the same greedy text as the base
    decoded to float32, by the CPU's MXFP4 decode kernel and by TPU's (interpreted)."""
    root, data = released
    text = generated(capsys, root / "hf", "--base-dtype", "mxfp4")
    assert text == generated(capsys, root / "hf") and "--- prompt: 'ROMEO'" in text
    # TPU's kernel (interpreted), its expert biases made in its [E, N, 1] once before the decode loop
    assert generated(capsys, root / "hf", "--base-dtype", "mxfp4", "--kernels", "moe_mxfp4=pallas") == text
    run = root / "mxfp4" if (root / "mxfp4").exists() else lora_run(root, data, root / "mxfp4", base_dtype="mxfp4")
    capsys.readouterr()
    adapted = generated(capsys, run, "--base-dtype", "mxfp4")
    assert adapted == generated(capsys, run) and adapted != text
    # merged as the base is read, its experts' bytes as stored (formats/lora_merge.py over ReleasedBytes)
    assert generated(capsys, run, "--base-dtype", "mxfp4", "--merge") == adapted


def test_eval_on_the_mxfp4_base_gives_the_decoded_bases_loss_and_task_scores(released, capsys):
    """`eval --base-dtype mxfp4` (validation loss through the step, and a multiple-choice task
    through the compiled scorer) equals the decoded base's within 1e-5."""
    from train.evaluation.validation import evaluate_checkpoint

    root, data = released
    a = evaluate_checkpoint(str(root / "hf"), data=data, batches=1, base_dtype="mxfp4")
    b = evaluate_checkpoint(str(root / "hf"), data=data, batches=1)
    assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5 * abs(b["val_loss"])
    from train.evaluation.requests import LoglikelihoodRequest
    from train.evaluation.scorer import load_scorer

    scores = []
    for base_dtype in ("mxfp4", "compute"):
        scorer, tokenizer, _ = load_scorer(str(root / "hf"), batch_size=2, max_length=32, base_dtype=base_dtype,
                                           progress=False)
        assert ("moe_mxfp4" in scorer.kernels) == (base_dtype == "mxfp4")
        ids = lambda text: tuple(tokenizer.encode_ordinary(text))            # noqa: E731
        results = scorer.loglikelihood([LoglikelihoodRequest(ids("ROMEO:"), ids(" But soft")),
                                        LoglikelihoodRequest(ids("JULIET"), ids(": O Romeo"))])
        scores.append([r.logprob for r in results])
    assert rel_err(np.array(scores[0]), np.array(scores[1])) < 1e-5


def test_the_adapter_of_an_mxfp4_base_run_loads_in_peft_onto_transformers_gpt_oss_with_our_logits(released, tmp_path):
    """The adapter file format is unchanged: `export --adapter` of the MXFP4-base run, loaded by
    peft onto transformers' gpt-oss read from the released directory, gives the logits of our
    model holding the experts as MXFP4."""
    import peft
    import transformers

    from formats.lora_inference import load_inference_model
    from parity.hf_parity import quantized_load
    from train.cli import main

    root, data = released
    run = root / "mxfp4" if (root / "mxfp4").exists() else lora_run(root, data, root / "mxfp4", base_dtype="mxfp4")
    assert main(["export", "--checkpoint", str(run), "--adapter", "--out", str(tmp_path / "adapter")]) == 0
    ours_model, _ = load_inference_model(run, base_dtype="mxfp4")
    assert has_mxfp4_experts(ours_model)
    ids = torch.tensor([[5, 17, 33, 2, 250, 7, 99]])
    base = transformers.AutoModelForCausalLM.from_pretrained(
        root / "hf", dtype=torch.float32, attn_implementation="eager", experts_implementation="eager",
        **quantized_load(root / "hf")).eval()
    with torch.no_grad():
        ours = ours_model(ids).double()
        theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits.double()
    assert float((theirs - ours).norm() / ours.norm()) <= 1e-5


def test_mxfp4_stacks_are_split_over_experts_or_output_rows_never_inside_a_block():
    """The sharding rule of MXFP4 stacks: experts over `expert`, `tensor` or `fsdp`; when fsdp does
    not divide the experts, the output rows; the blocked last axis (bytes and scale bytes) never."""
    from types import SimpleNamespace

    from jax_bridge.sharding import param_spec

    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    mesh = lambda **axes: SimpleNamespace(shape={"data": 1, "fsdp": 1, "expert": 1, "tensor": 1, **axes})  # noqa: E731
    spec = lambda n, shape, m: tuple(param_spec(n, shape, m)) + (None,) * (3 - len(param_spec(n, shape, m)))  # noqa: E731
    assert spec(name, (32, 5760, 1440), mesh(fsdp=4)) == ("fsdp", None, None)
    assert spec(name, (32, 5760, 1440), mesh(fsdp=2, expert=2)) == ("expert", "fsdp", None)
    assert spec(name, (32, 5760, 1440), mesh(fsdp=64)) == (None, "fsdp", None)
    assert spec(name.replace("_blocks", "_scales"), (32, 5760, 90), mesh(fsdp=64)) == (None, "fsdp", None)
    assert spec(name, (3, 96, 80), mesh(fsdp=5)) == (None, None, None)          # nothing divides: whole
    # `tensor` splits the experts (the stacks have no width to split), beside `expert` when both divide
    assert spec(name, (32, 5760, 1440), mesh(tensor=2)) == ("tensor", None, None)
    assert spec(name, (32, 5760, 1440), mesh(fsdp=2, tensor=2)) == ("tensor", "fsdp", None)
    assert spec(name, (32, 5760, 1440), mesh(expert=2, tensor=4)) == (("expert", "tensor"), None, None)
    assert spec(name, (6, 96, 80), mesh(expert=2, tensor=4)) == ("expert", None, None)


MXFP4_MESHES = ["expert=2,fsdp=2", "fsdp=4", "tensor=2,expert=2", "fsdp=2,tensor=2"]


@pytest.fixture(scope="module")
def mxfp4_dispatch_on_meshes():
    """tests/mxfp4_mesh_worker.py on 4 simulated CPU devices, once for every mesh: {mesh: errors}."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from worker_env import worker_env

    worker = Path(__file__).parent / "mxfp4_mesh_worker.py"
    proc = subprocess.run([sys.executable, str(worker), *MXFP4_MESHES], env=worker_env(4), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh", MXFP4_MESHES)
def test_the_mxfp4_dispatch_on_a_mesh_equals_one_device(mesh, mxfp4_dispatch_on_meshes):
    """Under a mesh the MXFP4 stacks are gathered per expert and the rows dispatched per device
    (tests/mxfp4_mesh_worker.py, 4 simulated CPU devices); under `tensor` the experts are split
    over it and the outputs summed: output and the gradients of the rows and the routing weights
    equal one device's."""
    result = mxfp4_dispatch_on_meshes[mesh]
    assert result["devices"] == 4
    assert result["forward"] < 1e-6 and result["dx"] < 1e-6 and result["dweights"] < 1e-6, result
