"""`torchlyra rl` end to end on a tiny chat model: LoRA with beta > 0 and mu = 2,
metrics (rewards, clip fractions, KL, entropy, sampler-vs-trainer difference), plots, checkpoints,
exact resume (the 2-step run's parameters = its checkpoint of step 1 resumed for 1 step), the
adapter exported for peft; a bad prompt file and an unknown reward exit 2 with one line."""
import json

import numpy as np
import pytest
import torch

from formats import checkpoint, tokenizer
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from train.cli import main

WORDS = "the king queen sword crown night day fair foul love hate war peace ghost witch storm sea".split()
MODEL = dict(n_layers=2, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, n_experts=2, expert_dim=32,
             sliding_window=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    enc = tokenizer.train_bpe([" ".join(WORDS)] * 30, 300)
    cfg = get_preset("tiny").replace(vocab_size=-(-enc.n_vocab // 128) * 128, bos_token_id=tokenizer.bos_id(enc),
                                     eos_token_id=tokenizer.end_id(enc), max_seq_len=64, **MODEL)
    torch.manual_seed(0)
    checkpoint.save_checkpoint(root / "base", GptOssForCausalLM(cfg).state_dict(), cfg, tokenizer=enc)
    rng = np.random.default_rng(0)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS, 3))}],
                                "answer": str(rng.choice(WORDS))}) + "\n")
    (root / "length.py").write_text("def short(prompt, completion, record):\n"
                                    "    return None if not completion else 1.0 / (1 + len(completion))\n")
    return root


def rl(root, out, *extra):
    return main(["rl", "--init-from", str(root / "base"), "--prompts", str(root / "prompts.jsonl"),
                 "--reward", "exact:answer", "--reward", f"python:{root / 'length.py'}:short", "--reward-weights", "1,0.5",
                 "--out", str(out), "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "5",
                 "--max-prompt-tokens", "32", "--lora", "r=2,alpha=4,targets=all-linear", "--beta", "0.04",
                 "--iterations", "2", "--micro-batches", "2", "--lr", "0.02", "--adam-lr", "0.01", "--kernels", "xla",
                 "--eval-prompts", str(root / "prompts.jsonl"), "--eval-every", "2", "--checkpoint-every", "1", *extra])


def adapters(run):
    from formats.checkpoint import find_checkpoint, restore_params_to_host, stored_shapes

    step_dir = find_checkpoint(run / "checkpoints")
    stored = {k: v for k, v in stored_shapes(step_dir).items() if k[0] == "params"}
    return restore_params_to_host(step_dir, stored)


@pytest.fixture(scope="module")
def two_steps(base, tmp_path_factory):
    """A 2-step run on one device."""
    out = tmp_path_factory.mktemp("rl-run") / "a"
    assert rl(base, out, "--steps", "2") == 0
    return out


def test_rl_run_logs_resumes_exactly_and_exports_the_adapter(base, two_steps, tmp_path):
    from train.generation.generator import load_for_generation

    run = two_steps
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for key in ("reward", "reward_std", "reward/exact:answer", "frac_reward_zero_std", "completion_length",
                "completion_length_min", "completion_length_max", "truncated_share", "kl", "clip_ratio/low",
                "clip_ratio/high", "entropy", "logp_diff/sampler_vs_trainer_max", "rollout_s", "update_s"):
        assert key in train[-1], key
    assert 0 <= train[0]["kl"] < 1e-2       # k3 >= 0; mean of mu = 2 updates, the first at policy = reference
    assert train[0]["logp_diff/sampler_vs_trainer_max"] <= 2e-5
    assert train[0]["completions"] == 6 and train[0]["entropy"] > 0
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 2]
    # Where the start went, up to the first update: its phases, and JAX's compiling inside them.
    (start,) = [r for r in records if r["kind"] == "startup"]
    assert start["step"] == 1 and start["compile_s"] > 0 and start["total_s"] >= start["first_update_s"] > 0
    assert {"parameters_s", "first_evaluation_s", "first_rollout_s"} <= set(start)
    assert (run / "plots" / "rewards.png").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["decoder_compilations"] == 4        # sampled and greedy: prefill + decode each, once
    assert summary["compile_count"] == 1       # the update step, once (sharding.one_device)

    # The run as it stood after its checkpoint of step 1 (its later one gone), resumed to step 2.
    import shutil

    shutil.copytree(run, tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "2")
    assert main(["rl", "--out", str(tmp_path / "b"), "--resume", "--steps", "2"]) == 0
    a, b = adapters(run), adapters(tmp_path / "b")
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert any(np.abs(v).max() > 0 for k, v in a.items() if "lora_B" in k)

    assert main(["export", "--checkpoint", str(base / "base"), "--out", str(tmp_path / "hf_base")]) == 0
    assert main(["export", "--checkpoint", str(run), "--adapter", "--out", str(tmp_path / "adapter"),
                 "--base-model", str(tmp_path / "hf_base")]) == 0
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    model, _ = load_for_generation(run)      # the run's checkpoint loads for generation
    assert any("lora_B" in n for n, _ in model.named_parameters())


def test_bad_input_is_one_line_exit_2(base, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt"}\n')
    for extra, words in ((["--prompts", str(tmp_path / "bad.jsonl")], "bad.jsonl:1: expected a field 'messages'"),
                         (["--reward", "bleu"], "unknown reward 'bleu'"),
                         (["--reward", f"python:{tmp_path / 'none.py'}:f"], "no file")):
        args = ["rl", "--init-from", str(base / "base"), "--prompts", str(base / "prompts.jsonl"),
                "--reward", "exact:answer", "--out", str(tmp_path / "x"), "--max-new-tokens", "4",
                "--max-prompt-tokens", "20", *extra]
        if extra[0] == "--reward":
            args = [a for i, a in enumerate(args) if not (a == "--reward" and args[i + 1] == "exact:answer")
                    and not (i and args[i - 1] == "--reward" and a == "exact:answer")]
        assert main(args) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and words in err[0], err


def test_rl_keeps_its_programs_in_the_compilation_cache_it_is_given(base, tmp_path, monkeypatch):
    """`--compile-cache` reaches the cache before anything compiles (as train's does: a second run
    loads its programs, tests/test_train_start.py), and a resumed run may change it."""
    from jax_bridge import compile_cache
    from train.rl.config import CHANGEABLE_ON_RESUME

    class Enabled(Exception):
        pass

    def enable(directory=None):
        raise Enabled(directory)

    monkeypatch.setattr(compile_cache, "enable", enable)
    with pytest.raises(Enabled, match=str(tmp_path / "cache")):
        rl(base, tmp_path / "run", "--steps", "1", "--compile-cache", str(tmp_path / "cache"))
    assert "compile_cache" in CHANGEABLE_ON_RESUME


def test_rl_config_file_takes_rl_fields_and_names_an_unknown_one(tmp_path):
    from formats.errors import UserError
    from train.rl.config import load_config_file

    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"group_size": 4, "beta": 0.04}))
    bad.write_text(json.dumps({"group_size": 4, "warmup_steps": 2}))     # a train field, not an rl one
    assert load_config_file(str(good)) == {"group_size": 4, "beta": 0.04}
    with pytest.raises(UserError, match=r"bad.json: unknown field\(s\) warmup_steps"):
        load_config_file(str(bad))


def test_rl_on_a_mesh_equals_one_device(base, two_steps, tmp_path):
    """The same LoRA run (beta > 0: the reference is the base with the adapters off; mu = 2) on
    fsdp=2 over 2 simulated devices, in a subprocess: rollouts sampled on the mesh, the update
    sharded, the greedy held-out evaluation on the mesh; its adapters equal one device's after 2
    steps."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.worker_env import PYTHONPATH

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
    script = ("import sys; from tests.test_rl_command import rl; from pathlib import Path; "
              "sys.exit(rl(Path(sys.argv[1]), Path(sys.argv[2]), '--steps', '2', '--mesh', 'fsdp=2'))")
    proc = subprocess.run([sys.executable, "-c", script, str(base), str(tmp_path / "mesh")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the decode loop under mesh fsdp=2" in proc.stdout
    one, mesh = adapters(two_steps), adapters(tmp_path / "mesh")
    assert set(one) == set(mesh)
    worst = max(float(np.abs(mesh[k] - v).max() / max(np.abs(v).max(), 1e-12)) for k, v in one.items())
    assert worst < 1e-5, worst
    rewards = [[json.loads(line)["reward"] for line in (run / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "train"] for run in (two_steps, tmp_path / "mesh")]
    assert rewards[0] == rewards[1]          # the same completions were sampled
