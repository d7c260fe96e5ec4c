"""`train --model-config`: a transformers model trained through the command line on the bundled
kind of corpus, checkpointed and resumed exactly; fine-tuned from its run with LoRA (SFT, DPO and
`rl`), each adapter loading in peft onto transformers' model with our logits; what is not built
is refused by name."""
import json
import re

import pytest

from helpers import PLAY_LINES, assert_generates_as, one_line_error, prepare_play_corpus
from train.cli import main
from train.generation.generator import Generator

# Qwen3-MoE: a dense layer between MoE ones, its router loss; the prepared corpus has 320 ids.
CONFIG = {"model_type": "qwen3_moe", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
          "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1],
          "output_router_logits": True, "router_aux_loss_coef": 0.01, "max_position_embeddings": 128}
ARGS = ["--batch-size", "4", "--seq-len", "64", "--samples", "0", "--eval-every", "6", "--eval-batches", "2",
        "--log-every", "1", "--checkpoint-every", "6", "--lr", "0.02", "--adam-lr", "0.01"]
PROMPTS = [[319, 40, 41, 42, 43, 44, 45, 46, 47], [319, 60]]     # 319: the corpus tokenizer's document start


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_train")
    prepare_play_corpus(root)
    (root / "qwen3_moe.json").write_text(json.dumps(CONFIG))
    return root


@pytest.fixture(scope="module")
def pairs(root):
    """root/pairs: preference pairs (which speaker says a line: the right one chosen, another
    rejected) prepared with the corpus's tokenizer (`prepare --preferences`), train and val."""
    import numpy as np

    rng = np.random.default_rng(0)
    speakers = [line.split(":")[0] for line in PLAY_LINES]

    def pair(i):
        line = PLAY_LINES[i % 4]
        words = line.split(": ", 1)[1].split()
        said = " ".join(words[:rng.integers(2, len(words))])
        other = speakers[(i + 1 + rng.integers(0, 3)) % 4]
        say = lambda role, text: [{"role": role, "content": text}]   # noqa: E731
        return json.dumps({"prompt": say("user", f"Who says: {said}"), "chosen": say("assistant", speakers[i % 4]),
                           "rejected": say("assistant", other)})

    (root / "pairs.jsonl").write_text("".join(pair(i) + "\n" for i in range(24)))
    (root / "pairs_val").mkdir()
    (root / "pairs_val" / "val.jsonl").write_text("".join(pair(i) + "\n" for i in range(2)))
    assert main(["prepare", "--preferences", "--input", str(root / "pairs.jsonl"), "--val-input",
                 str(root / "pairs_val"), "--tokenizer", str(root / "data"), "--out", str(root / "pairs"),
                 "--workers", "1"]) == 0
    return root / "pairs"


def dpo_records(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]


def assert_dpo_trains(base_run, pairs, out, *extra):
    """`train --init-from RUN --dpo --lora` on the pairs: the first step's DPO loss is log 2 (the
    policy is the reference: the adapters start at B = 0), and after one update the second
    step's chosen answers are ahead of the rejected ones on average (a high adapter learning rate:
    one step from B = 0 moves the margins little)."""
    import math

    assert main(["train", "--init-from", str(base_run), "--data", str(pairs), "--dpo", "beta=0.1", "--lora",
                 "r=4,alpha=8", "--out", str(out), *ARGS, "--steps", "2", "--seq-len", "120",
                 "--batch-size", "2", "--lr", "0.2", *extra]) == 0
    first, second = dpo_records(out)
    assert first["dpo_loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert second["rewards/margins"] > 0 and second["dpo_loss"] < math.log(2)


@pytest.fixture(scope="module")
def whole(root):
    """An uninterrupted 12-step run."""
    assert train(root, "whole", 12) == 0
    return root / "whole"


def train(root, out: str, steps: int, *extra) -> int:
    return main(["train", "--model-config", str(root / "qwen3_moe.json"), "--data", str(root / "data"),
                 "--out", str(root / out), "--steps", str(steps), *ARGS, *extra])


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"}


def test_a_transformers_model_trains_checkpoints_and_resumes_exactly(root, whole):
    summary = json.loads((whole / "summary.json").read_text())
    assert summary["val_loss_end"] < summary["val_loss_start"]
    record = json.loads((whole / "metrics.jsonl").read_text().splitlines()[0])
    assert record["model"] == {"transformers": {**CONFIG, "bos_token_id": record["model"]["transformers"]["bos_token_id"],
                                                "eos_token_id": record["model"]["transformers"]["eos_token_id"]}}
    assert record["flops_per_token"] > 0 and record["active_params"] < record["params"]
    train_records = [r for r in map(json.loads, (whole / "metrics.jsonl").read_text().splitlines())
                     if r["kind"] == "train"]
    assert train_records[-1]["expert_load_max"] > 0
    # Stopped at step 6 (the run as it stood after its checkpoint of step 6, its later checkpoint
    # gone), resumed to 12: the losses of the uninterrupted run.
    import shutil

    shutil.copytree(whole, root / "halves")
    shutil.rmtree(root / "halves" / "checkpoints" / "12")
    assert train(root, "halves", 12, "--resume") == 0
    uninterrupted, halves = losses(whole), losses(root / "halves")
    assert sorted(halves) == sorted(uninterrupted) == list(range(1, 13))
    assert all(abs(halves[s] - uninterrupted[s]) <= 1e-6 * abs(uninterrupted[s]) for s in uninterrupted), \
        (halves, uninterrupted)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_dense_families_train_and_their_dpo_and_rl_adapters_load_in_peft(root, pairs, family, tmp_path):
    """Llama (llama3 rope scaling, tied head) and Qwen3 (a sliding layer after a full one) from
    their transformers configs: `train --model-config` lowers the validation loss. From the run,
    Llama: DPO with LoRA (`assert_dpo_trains`). Qwen3: `rl` (GRPO) with LoRA and the head trained
    whole, on a reward checked by a rule (the completion names Romeo): the rollout reward rises
    from near 0 to near 1 in 12 steps. Either adapter, exported for peft beside the exported
    base, loads onto transformers' model with our logits within 1e-5, and merged it exports as
    transformers loads it."""
    from tests.transformers_configs import CONFIGS

    config = {**CONFIGS[family]().to_dict(), "vocab_size": CONFIG["vocab_size"], "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["train", "--model-config", str(tmp_path / "config.json"), "--data", str(root / "data"), "--out",
                 str(tmp_path / "run"), "--steps", "8", *ARGS, "--eval-every", "4", "--checkpoint-every", "8"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["val_loss_end"] < summary["val_loss_start"]
    if family == "llama":
        assert_dpo_trains(tmp_path / "run", pairs, tmp_path / "lora")
    else:
        (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": line.split(":")[0] + ":"}) + "\n"
                                                        for line in PLAY_LINES))
        assert main(["rl", "--init-from", str(tmp_path / "run"), "--prompts", str(tmp_path / "prompts.jsonl"),
                     "--reward", "regex:Romeo", "--out", str(tmp_path / "lora"), "--steps", "12", "--prompts-per-step",
                     "4", "--group-size", "8", "--max-new-tokens", "6", "--max-prompt-tokens", "8", "--lora",
                     "r=4,alpha=8,modules_to_save=lm_head", "--lr", "0.02", "--adam-lr", "0.01", "--kernels", "xla",
                     "--checkpoint-every", "12"]) == 0
        rewards = [r["reward"] for r in dpo_records(tmp_path / "lora")]
        assert len(rewards) == 12 and rewards[0] <= 0.25 and sum(rewards[-3:]) / 3 >= 0.75, rewards
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "base")]) == 0
    peft_model = assert_adapter_loads_in_peft(tmp_path / "lora", tmp_path / "base", tmp_path / "adapter")
    # Exported merged (one tensor at a time, formats/lora_merge.py; Llama's tied head once): what
    # transformers loads gives peft's merged logits.
    import torch
    from transformers import AutoModelForCausalLM

    assert main(["export", "--checkpoint", str(tmp_path / "lora"), "--out", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 24))
    with torch.no_grad():
        ours, theirs = merged(ids).logits, peft_model.merge_and_unload()(ids).logits
    assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-5


def assert_adapter_loads_in_peft(lora_run, base_dir, adapter_dir):
    """Export `lora_run`'s adapter for peft on `base_dir` (an export of its base); peft's model on
    transformers' eager one gives the run's logits within 1e-5, and the adapters change them.
    Returns peft's model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from formats.lora_checkpoint import load_lora_model

    assert main(["export", "--checkpoint", str(lora_run), "--adapter", "--base-model", str(base_dir),
                 "--out", str(adapter_dir)]) == 0
    wrapped, _, _ = load_lora_model(lora_run)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 24))
    base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager", experts_implementation="eager")
    with torch.no_grad():
        plain = base(ids).logits
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        ours, theirs = wrapped(ids), peft_model(ids).logits
    assert (ours - plain).abs().max() > 1e-3                     # the adapters changed the model
    assert ((theirs - ours).norm() / ours.norm()).item() <= 1e-5
    return peft_model


def test_what_is_not_built_for_transformers_models_is_refused_in_one_line(root, whole, capsys):
    data = ["--data", str(root / "data"), "--out", str(root / "refused")]
    config = ["--model-config", str(root / "qwen3_moe.json")]
    assert "two models" in one_line_error(capsys, ["train", *config, "--preset", "tiny", "--samples", "0", *data])
    assert "exceed the config's max_position_embeddings (128)" in one_line_error(capsys, ["train", *config, *data])
    assert "drop model_config" in one_line_error(capsys, ["train", *config, "--init-from", str(whole), "--samples", "0",
                                                          *data])
    (root / "bad.json").write_text(json.dumps({"model_type": "no_such_family", "vocab_size": 320}))
    assert "no_such_family" in one_line_error(capsys, ["train", "--model-config", str(root / "bad.json"),
                                                       "--samples", "0", *data])
    (root / "bloom.json").write_text(json.dumps({"model_type": "bloom", "vocab_size": 320, "hidden_size": 32,
                                                 "n_layer": 1, "n_head": 2}))
    assert "skeleton" in one_line_error(capsys, ["train", "--model-config", str(root / "bloom.json"), "--samples", "0",
                                                 *data])
    (root / "dropout.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 320, "hidden_size": 32,
                                                   "intermediate_size": 48, "num_hidden_layers": 1,
                                                   "num_attention_heads": 2, "attention_dropout": 0.1}))
    assert "attention_dropout=0.1" in one_line_error(capsys, ["train", "--model-config", str(root / "dropout.json"),
                                                              "--samples", "0", *data])
    assert "mxfp4" in one_line_error(capsys, ["export", "--checkpoint", str(whole), "--out", str(root / "q"),
                                              "--dtype", "mxfp4"])
    assert not (root / "q").exists()


def test_eval_reproduces_the_runs_validation_loss_and_bits_per_byte(whole, tmp_path):
    assert main(["eval", "--checkpoint", str(whole), "--json", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    last = [r for r in map(json.loads, (whole / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"][-1]
    assert result["step"] == last["step"] == 12
    assert result["val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert result["val_bpb"] == pytest.approx(last["val_bpb"], rel=1e-6)


@pytest.fixture(scope="module")
def exported(root, whole):
    out = root / "exported"
    assert main(["export", "--checkpoint", str(whole), "--out", str(out)]) == 0
    return out


def test_export_writes_what_transformers_loads_with_the_runs_logits_and_tokenizer(root, whole, exported):
    """`torchlyra export` of the run: transformers' own directory (config, per-expert tensors,
    tokenizer), loaded by from_pretrained / AutoTokenizer with the checkpoint's logits and ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from formats import checkpoint
    from formats.model_checks import load_weights
    from formats.tokenizer import load_tokenizer

    out = exported
    spec, meta, params = checkpoint.iter_params(whole)
    ours = spec.build()
    load_weights(ours, {n: torch.from_numpy(v) for n, v in params})
    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", experts_implementation="eager")
    assert type(loaded).__name__ == "Qwen3MoeForCausalLM" and loaded.config.bos_token_id == spec.config["bos_token_id"]
    text = PLAY_LINES[0]
    enc = load_tokenizer(checkpoint.tokenizer_dir(whole, meta))
    ids = enc.encode(text)
    assert AutoTokenizer.from_pretrained(out).encode(text, add_special_tokens=False) == ids
    ids = torch.tensor([ids[:40]])
    with torch.no_grad():
        expected, got = ours(ids), loaded(ids).logits
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5


def test_lora_on_the_run_loads_in_peft_with_our_logits_and_resumes(root, whole, exported, capsys, monkeypatch):
    """`train --init-from RUN --lora` on the transformers run (attention and expert adapters
    through peft): it starts from the base's loss and resumes; its adapter, exported for peft,
    loads onto transformers' model of the exported base with our logits, and the merged export
    loads in transformers with them too; `parity --checkpoint` takes the LoRA run."""
    import torch
    from transformers import AutoModelForCausalLM

    import parity.run
    from formats import checkpoint
    from formats.lora_checkpoint import load_lora_model

    lora = ["--init-from", str(whole), "--lora", "r=4,alpha=8,targets=all-linear+experts", "--data",
            str(root / "data"), "--out", str(root / "lora"), *ARGS]
    assert main(["train", *lora, "--steps", "6"]) == 0
    evals = [r for r in map(json.loads, (root / "lora" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    base_end = [r for r in map(json.loads, (whole / "metrics.jsonl").read_text().splitlines())
                if r["kind"] == "eval"][-1]["val_loss"]
    assert evals[0]["step"] == 0 and evals[0]["val_loss"] == pytest.approx(base_end, rel=1e-5)   # B = 0 at start
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert main(["train", *lora, "--steps", "8", "--resume"]) == 0
    assert sorted(losses(root / "lora"))[-1] == 8
    peft_model = assert_adapter_loads_in_peft(root / "lora", exported, root / "adapter")
    assert main(["export", "--checkpoint", str(root / "lora"), "--out", str(root / "merged")]) == 0
    assert main(["eval", "--checkpoint", str(root / "lora")]) == 0
    wrapped, _, _ = load_lora_model(root / "lora")
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 24))
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", attn_implementation="eager",
                                                  experts_implementation="eager")
    with torch.no_grad():
        ours, folded = wrapped(ids), merged(ids).logits
    assert ((folded - ours).norm() / ours.norm()).item() <= 1e-5
    # Generation with the adapters unmerged on the compiled decoder: peft's model's greedy tokens.
    assert_generates_as(Generator.from_checkpoint(root / "lora"), peft_model, PROMPTS)
    # `parity --checkpoint` of the LoRA run hands the LoRA rows (run on these families in
    # tests/test_transformers_models.py) the run's base weights and trained adapters.
    handed = {}

    def record(cfg, spec, state, adapters, **kwargs):
        handed.update(cfg=cfg, spec=spec, state=state, adapters=adapters)
        raise SystemExit(0)

    monkeypatch.setattr(parity.run, "run_lora_parity", record)
    with pytest.raises(SystemExit):
        main(["parity", "--checkpoint", str(root / "lora"), "--kernels", "xla"])
    assert handed["cfg"].model_type == "qwen3_moe"
    assert str(handed["spec"]) == "r=4,alpha=8,dropout=0,targets=all-linear+experts"
    trained = dict(wrapped.named_parameters())
    assert handed["adapters"].keys() == {n for n, p in trained.items() if p.requires_grad}
    assert all(torch.equal(handed["adapters"][n], trained[n]) for n in handed["adapters"])
    base = {n: torch.from_numpy(v) for n, v in checkpoint.iter_params(whole)[2]}
    assert handed["state"].keys() == base.keys() and all(torch.equal(handed["state"][n], base[n]) for n in base)


def test_dpo_on_the_run(root, whole, pairs, tmp_path):
    """`train --dpo` with LoRA on the Qwen3-MoE run (attention adapters; its router loss in the
    objective): `assert_dpo_trains`."""
    assert_dpo_trains(whole, pairs, tmp_path / "dpo")


def test_generate_and_task_scores_of_the_run_are_transformers_own(root, whole, exported, capsys, tmp_path):
    """`generate` and `eval --tasks` of a `train --model-config` run: the compiled decoder's greedy
    tokens are transformers' own `generate` on the export, and the compiled scorer's
    log-likelihoods (shared contexts, several lengths) are the exported model's, within 1e-5."""
    import torch
    from transformers import AutoModelForCausalLM

    from train.evaluation.requests import LoglikelihoodRequest
    from train.evaluation.scorer import load_scorer

    reference = AutoModelForCausalLM.from_pretrained(exported, attn_implementation="eager",
                                                     experts_implementation="eager").eval()
    assert_generates_as(Generator.from_checkpoint(whole), reference, PROMPTS)
    assert main(["generate", "--checkpoint", str(whole), "--prompt", "ROMEO:", "--max-tokens", "8"]) == 0
    assert "ROMEO:" in capsys.readouterr().out
    requests = [LoglikelihoodRequest((319, 40, 41, 42), (43, 44)), LoglikelihoodRequest((319, 40, 41, 42), (50,)),
                LoglikelihoodRequest((319,) + tuple(range(60, 90)), (91, 92, 93))]
    scorer, _, _ = load_scorer(whole)
    for request, got in zip(requests, scorer.loglikelihood(requests)):
        ids = torch.tensor([request.context + request.continuation])
        with torch.no_grad():
            logps = torch.log_softmax(reference(ids).logits[0, :-1].float(), -1)
        n = len(request.continuation)
        targets = ids[0, -n:]
        expected = logps[-n:].gather(1, targets[:, None]).sum().item()
        assert got.logprob == pytest.approx(expected, rel=1e-5, abs=1e-5)
        assert got.greedy == bool((logps[-n:].argmax(-1) == targets).all())
    (tmp_path / "lm.jsonl").write_text(json.dumps({"context": "ROMEO:", "continuation": " But soft"}) + "\n")
    assert main(["eval", "--checkpoint", str(whole), "--tasks", str(tmp_path / "lm.jsonl"),
                 "--json", str(tmp_path / "tasks.json")]) == 0
    assert json.loads((tmp_path / "tasks.json").read_text())["tasks"][0]["examples"] == 1


def test_freeze_on_the_run_leaves_the_frozen_parameters_as_the_base_holds_them(root, whole, tmp_path):
    """--freeze on the run; its evaluations also score a task and its end writes samples."""
    from formats import checkpoint

    (tmp_path / "lm.jsonl").write_text(json.dumps({"context": "ROMEO:", "continuation": " But soft"}) + "\n")
    assert main(["train", "--init-from", str(whole), "--freeze", "model.embed_tokens.*", "--data", str(root / "data"),
                 "--out", str(root / "frozen"), *ARGS, "--steps", "2", "--checkpoint-every", "2", "--eval-every", "2",
                 "--eval-tasks", str(tmp_path / "lm.jsonl"), "--samples", "1"]) == 0
    evals = [r for r in map(json.loads, (root / "frozen" / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    assert evals and all(set(r["tasks"]) == {"lm"} for r in evals)
    samples = json.loads((root / "frozen" / "summary.json").read_text())["samples"]
    assert len(samples) == 1 and len(samples[0]["text"]) > len(samples[0]["prompt"])
    base = dict(checkpoint.iter_params(whole)[2])
    after = dict(checkpoint.iter_params(root / "frozen")[2])
    assert sorted(after) == sorted(base)
    assert (after["model.embed_tokens.weight"] == base["model.embed_tokens.weight"]).all()
    assert not (after["model.norm.weight"] == base["model.norm.weight"]).all()


def test_parity_of_the_run_against_transformers_eager_attention_and_experts(whole, tmp_path, capsys):
    """`torchlyra parity --checkpoint` of the trained run: the lowered step against transformers'
    own eager attention and experts on the run's weights (packed rows, routing forced as the eager
    run chose and weighted as the family's router weights); the kernel matrix of random models is
    tests/test_transformers_models.py's."""
    assert main(["parity", "--checkpoint", str(whole), "--kernels", "xla", "--dtype", "float32",
                 "--json", str(tmp_path / "parity.json")]) == 0
    report = json.loads((tmp_path / "parity.json").read_text())
    err = capsys.readouterr().err
    assert "transformers eager attention and experts" in err
    # Where the command's time went: the phases, then JAX's share inside them.
    assert re.search(r"^time [\d.]+ s: imports [\d.]+ s, the checks [\d.]+ s; inside them hashing [\d.]+ s .*, "
                     r"compile [\d.]+ s; compilation cache", err, re.M), err[-2000:]
    assert report["passed"] and {r["category"] for r in report["entries"]} >= {"logits", "loss", "grad", "param",
                                                                                "routing"}
