"""`train --module`: a user's own nn.Module through the whole stack. Four modules: examples/gpt.py's
nanoGPT-style GPT (GQA through SDPA), its mixture of experts over 3-D expert stacks
(torch._grouped_mm), and two published pure-PyTorch implementations from the package index,
x-transformers' decoder and torchtune's Llama 3. Each trains through the command line (validation
loss falls; stopped and resumed, the losses of one uninterrupted run, bit for bit), reports what
went where, exports its weights in its own names (strict `safetensors.torch.load_model` gives the
run's logits), generates the eager module's greedy tokens, and passes parity against its own eager
forward for every kernel set it routes, in float32 and bf16."""
import json
import sys

import numpy as np
import pytest
import torch

from helpers import prepare_play_corpus, rel_err
from train.cli import main

GPT = dict(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128)
MODELS = {
    "gpt": ("examples/gpt.py:GPT", GPT),
    "gpt_moe": ("examples/gpt.py:GPT", {**GPT, "dim": 64, "n_experts": 4, "top_k": 2, "hidden": 64}),
    "x_transformers": ("examples/x_transformers_gpt.py:gpt",
                       dict(vocab_size=320, dim=32, depth=2, heads=4, kv_heads=2, max_seq_len=128)),
    "torchtune": ("torchtune.models.llama3._component_builders:llama3",
                  dict(vocab_size=320, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=128,
                       intermediate_dim=64)),
}
# What each one's forward gives the bridge: blocks run as the layers (scanned) or unrolled.
SCANNED = {"gpt": True, "gpt_moe": True, "x_transformers": False, "torchtune": True}
ARGS = ["--batch-size", "4", "--seq-len", "32", "--samples", "0", "--eval-every", "4", "--eval-batches", "2",
        "--log-every", "1", "--checkpoint-every", "2", "--adam-lr", "0.01"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return prepare_play_corpus(tmp_path_factory.mktemp("module_corpus"))


def module_args(name: str) -> list[str]:
    spec, args = MODELS[name]
    return ["--module", spec, "--module-args", json.dumps(args)]


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"}


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory):
    """trained(name) -> (name, a 4-step run, the same run stopped at step 2 and resumed to 4), each
    module's runs made once."""
    made = {}

    def runs(name):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            train = ["train", *module_args(name), "--data", data, *ARGS]
            assert main([*train, "--out", str(root / "whole"), "--steps", "4"]) == 0
            assert main([*train, "--out", str(root / "halves"), "--steps", "2"]) == 0
            assert main(["train", "--out", str(root / "halves"), "--resume", "--steps", "4"]) == 0
            made[name] = (name, root / "whole", root / "halves")
        return made[name]
    return runs


@pytest.fixture(params=list(MODELS))
def run(request, trained):
    return trained(request.param)


def run_model(run_dir):
    """The run's model on the host, with its newest weights, and its record."""
    from formats.checkpoint import load_checkpoint
    from formats.model_checks import build_model, load_weights

    state, record, _ = load_checkpoint(run_dir, transformers_ok=True)
    model = build_model(record)
    load_weights(model, state)
    return model.eval(), record


def test_a_module_trains_resumes_exactly_and_reports_what_went_where(run):
    name, whole, halves = run
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["val_loss_end"] < summary["val_loss_start"]
    assert losses(halves) == losses(whole) and sorted(losses(whole)) == [1, 2, 3, 4]   # bit for bit
    record = json.loads((whole / "metrics.jsonl").read_text().splitlines()[0])
    spec, args = MODELS[name]
    assert record["model"]["module"]["spec"] == spec and record["model"]["module"]["args"] == args
    assert record["flops_per_token"] > 6 * 32 * 320 and record["params"] > 0
    attention, head, blocks = record["routing"]
    assert attention.startswith("attention: 2 of 2 SDPA calls -> attention="), attention
    assert "fused with the cross-entropy op" in head, head
    assert ("run as the layers" in blocks) == SCANNED[name], blocks


def test_export_loads_strictly_into_the_module_with_the_runs_logits(run, tmp_path):
    import safetensors.torch

    from torch_model.module_lm import instantiate

    name, whole, _ = run
    assert main(["export", "--checkpoint", str(whole), "--out", str(tmp_path / "out")]) == 0
    recorded = json.loads((tmp_path / "out" / "torchlyra_module.json").read_text())
    assert (recorded["spec"], recorded["args"]) == MODELS[name]
    module = instantiate(recorded["spec"], recorded["args"]).eval()
    missing, unexpected = safetensors.torch.load_model(module, str(tmp_path / "out" / "model.safetensors"))
    assert not missing and not unexpected
    model, _ = run_model(whole)
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(tokens), model.module(tokens)
        exported = module(tokens)
    exported = exported.logits if hasattr(exported, "logits") else exported
    assert rel_err(exported.float(), theirs.float()) <= 1e-6 and rel_err(ours.float(), theirs.float()) <= 1e-5


def test_generate_gives_the_eager_modules_greedy_tokens(run):
    """Left-padded prompts of two lengths, through the compiled decode loop: with the module's own
    cache, or recomputing each row's tokens every step."""
    from train.generation.generator import Generator, generate

    name, whole, _ = run
    model, record = run_model(whole)
    # examples/gpt.py brings its own KV cache (the decode cache protocol); the others are recomputed.
    assert model.follows_cache_protocol == name.startswith("gpt")
    prompts = [[record.bos_token_id, 40, 41, 42, 43, 44], [record.bos_token_id, 60]]
    ours = generate(Generator(model), prompts, max_new_tokens=8, temperature=0.0).tokens
    for prompt, tokens in zip(prompts, ours):
        seq = list(prompt)
        for _ in range(8):
            with torch.no_grad():
                out = model.module(torch.tensor([seq]))
            seq.append(int((out.logits if hasattr(out, "logits") else out)[0, -1].argmax()))
        assert tokens == seq[len(prompt):], (tokens, seq[len(prompt):])


def test_parity_passes_for_every_kernel_set_the_module_routes(run):
    """Its SDPA calls and its head reach the attention and cross-entropy ops: both kernel sets
    (the plain JAX references, the Pallas kernels), in float32 and bf16, against the module's own
    eager forward and its logits' cross-entropy."""
    from formats.model_checks import module_record
    from parity.runs import FAST_COMPILE
    from parity.suite import run_parity

    name = run[0]
    report = run_parity(module_record(*MODELS[name], 0), kernel_sets=["xla", "attention=pallas,cross_entropy=pallas"],
                        dtypes=("float32", "bfloat16"), segments=False, batch=2, seq_len=48,
                        compiler_options=FAST_COMPILE)
    assert report.passed, report.format()
    assert {row.dtype for row in report.rows} == {"float32", "bfloat16"}
    if name == "gpt_moe":
        # The lowered run takes the eager router logits (parity.runs.forced_router_logits): its
        # top-k chooses the eager experts. Left to its own bf16 router logits, a near-tie here
        # sends a token elsewhere (top1 0.990, kl_excess 5e-5).
        bf16 = [row for row in report.rows if row.category == "logits" and row.dtype == "bfloat16"]
        assert bf16 and all(row.metrics["top1"] == 1.0 and row.metrics["kl_excess"] < 1e-5 for row in bf16), bf16


def test_parity_names_a_module_whose_forward_fails_at_the_parity_shape():
    """A module built for shorter rows than the parity run's (the chip's parity shape is 320 tokens
    a row) is named in one line with the shape, not left as a traceback from inside its forward."""
    from formats.errors import UserError
    from formats.model_checks import module_record
    from parity.suite import run_parity

    with pytest.raises(UserError, match=r"--module examples/gpt.py:GPT: its eager forward failed on 2 x 200 tokens "
                                        r"\(RuntimeError: .*\); a module that takes fewer tokens a row needs --seq-len"):
        run_parity(module_record(*MODELS["gpt"], 0), kernel_sets=["xla"], segments=False, batch=2, seq_len=200)


@pytest.fixture(scope="module")
def mesh_runs(data, tmp_path_factory):
    """Every module trained as `run` trains it, on fsdp=2,tensor=2 over 4 simulated CPU devices (one
    subprocess): {name: {"losses": ..., "tensor": the parameters split over `tensor`}}."""
    import subprocess

    from tests.worker_env import ROOT, worker_env

    out = tmp_path_factory.mktemp("module_mesh")
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "module_mesh_worker.py"), data, str(out), *MODELS],
                          cwd=ROOT, env=worker_env(devices=4), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {name: {"losses": {int(k): v for k, v in r["losses"].items()}, "tensor": r["tensor"]}
            for name, r in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def test_a_mesh_run_gives_the_one_device_losses_with_its_matrices_split_by_role(run, mesh_runs):
    """fsdp=2,tensor=2: the widening and narrowing projections found by structure (the probe's
    roles, no names) split over `tensor`, and the losses are the one-device run's."""
    name, whole, _ = run
    one_device, mesh = losses(whole), mesh_runs[name]["losses"]
    assert sorted(mesh) == sorted(one_device)
    assert all(abs(mesh[s] - one_device[s]) <= 1e-5 * abs(one_device[s]) for s in one_device), (mesh, one_device)
    assert len(mesh_runs[name]["tensor"]) >= 4, mesh_runs[name]["tensor"]


def test_plan_compiles_the_modules_step_for_a_v5e_slice(run, capsys):
    """The module built on meta, its step compiled by the TPU compiler for v5e:2x2 with the Pallas
    kernels its calls reach."""
    name = run[0]
    assert main(["plan", *module_args(name), "--topology", "v5e:2x2", "--seq-len", "64", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "attention=pallas, cross_entropy=pallas" in out, out


def test_a_killed_run_resumes_to_the_uninterrupted_losses_bitwise(trained, data, tmp_path):
    """SIGKILL after the step-2 checkpoint of examples/gpt.py's run (resuming is the same code for
    every module: the others stop and resume in `trained`), then --resume."""
    import os
    import signal
    import subprocess
    import time

    from tests.worker_env import ROOT

    name, whole, _ = trained("gpt")
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "train.cli", "train", *module_args(name), "--data", data, *ARGS,
                             "--steps", "4", "--checkpoint-every", "1", "--out", str(killed)],
                            cwd=ROOT, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and not (killed / "checkpoints" / "2" / "torchlyra_manifest.json").exists():
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)        # the run's last steps, evaluation and plots take a second or more
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert main(["train", "--out", str(killed), "--resume", "--steps", "4"]) == 0
    assert losses(killed) == losses(whole)
