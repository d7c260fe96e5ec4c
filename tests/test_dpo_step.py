"""The DPO objective in the lowered train step: at the first step (policy = reference)
TRL's losses are log 2 (sigmoid) and 1 / (4 beta^2) (IPO); against the eager torch oracle beside
the model (torch_model/preference.py: full logits and log_softmax, not the fused cross-entropy)
the loss and every gradient match on packed rows of pairs with padding; micro-batches give the
big batch's mean over pairs.

Float32 on CPU, one tiny MoE model (two layers: sliding window and full), router loss
coefficients 0 where batches are split (the router's losses are batch statistics).
"""
import functools
import math

import jax
import numpy as np
import pytest
import torch

from helpers import rel_err
from jax_bridge.preference import reference_params
from jax_bridge.step import StepConfig, TrainStep
from torch_model.config import get_preset
from torch_model.lora import apply_lora, parse_lora_spec
from torch_model.model import GptOssForCausalLM
from torch_model.preference import PreferenceConfig, dpo_loss_eager, parse_preference_spec

ROW = 41
SIGMOID = PreferenceConfig(beta=0.1, loss="sigmoid", label_smoothing=0.1)
IPO = PreferenceConfig(beta=0.1, loss="ipo")
# The loss's bound. TPU float32's log is not correctly rounded. Measured on a v5e (2026-12-06,
# against float64): log_sigmoid and softplus were off by up to rel 2.6e-4 (4,008 ulps, at |x| =
# 1.21), log1p by up to 2.6e-4, log by up to 9.6e-5. Its exp was within 5.9e-6. The sigmoid loss
# is two log_sigmoid values per pair, so on a TPU it is held to 3e-4. Its inputs, the log-probabilities
# and rewards, stay at 1e-5, and the gradients at 1e-4. On the chip (2026-12-06) the loss was off
# by 2.0e-5 (CPU: 6e-8), and IPO, which takes no log, passed.
LOSS_BOUND = {"tpu": 3e-4}


def tiny_model(seed=1):
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(vocab_size=96, d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, n_layers=2,
                                     n_experts=4, expert_dim=16, sliding_window=6, router_aux_loss_coef=0.0, router_z_loss_coef=0.0,
                                     max_seq_len=ROW - 1)
    model = GptOssForCausalLM(cfg)
    model.reset_parameters(seed=seed)
    return model


def pair_row(pairs, seed):
    """One packed row: for each (prompt, chosen, rejected) length, prompt + chosen then the SAME
    prompt + rejected as segments 2k+1, 2k+2; answer tokens weighted; the rest padding."""
    rng = np.random.default_rng(seed)
    row = {"tokens": np.zeros((1, ROW), np.int32), "weights": np.zeros((1, ROW), np.float32),
           "segment_ids": np.zeros((1, ROW), np.int32), "positions": np.zeros((1, ROW), np.int32)}
    at, seg = 0, 1
    for p, c, r in pairs:
        prompt = rng.integers(1, 96, p)
        for n in (c, r):
            tokens = np.concatenate([prompt, rng.integers(1, 96, n)])
            k = len(tokens)
            row["tokens"][0, at:at + k], row["weights"][0, at + p:at + k] = tokens, 1
            row["segment_ids"][0, at:at + k], row["positions"][0, at:at + k] = seg, np.arange(k)
            at, seg = at + k, seg + 1
    assert at < ROW                       # some padding at the end
    return row


def batch(rows):
    return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}


ROWS = batch([pair_row([(5, 4, 3), (3, 2, 6)], 0), pair_row([(6, 5, 9)], 1)])      # 3 pairs, padded


def torch_batch(b):
    return {k: torch.tensor(v) for k, v in b.items()}


@functools.lru_cache(maxsize=None)
def full_step(cfg: PreferenceConfig):
    model = tiny_model()
    return model, TrainStep(model, step_cfg=StepConfig(kernels="xla", compute_dtype="float32", preference=cfg))


@functools.lru_cache(maxsize=None)
def lora_step(cfg: PreferenceConfig):
    model = tiny_model()
    wrapped = apply_lora(model, parse_lora_spec("r=2,alpha=4,targets=all-linear"))
    step = TrainStep(wrapped, step_cfg=StepConfig(kernels="xla", compute_dtype="float32", preference=cfg))
    return wrapped, step, step.init_state()


def perturbed_reference(step, params, seed=3):
    """The step's own reference values, shifted so the loss is not at its policy = reference point."""
    sums = np.asarray(step.answer_logps(params, ROWS))
    return sums + np.random.default_rng(seed).normal(0, 2.0, sums.shape).astype(np.float32)


def test_spec_parses_and_refuses_by_name():
    assert parse_preference_spec("beta=0.2,loss=ipo") == PreferenceConfig(beta=0.2, loss="ipo")
    from torch_model.config import ConfigError
    for bad, words in (("beta=0", "beta must be > 0"), ("loss=kto", "loss must be one of sigmoid, ipo"),
                       ("gamma=1", "keys beta, loss, label_smoothing"), ("loss=ipo,label_smoothing=0.1", "applies to")):
        with pytest.raises(ConfigError, match=words):
            parse_preference_spec(bad)


def test_first_step_loss_is_log2_for_sigmoid_and_quarter_over_beta_squared_for_ipo():
    """With LoRA the reference is the same step with every lora_B zero: at initialisation (B = 0)
    policy and reference are the same numbers, so TRL's losses sit at their known values; the
    reference is stopped, so the gradient is the policy's alone (non-zero: -beta/2 x d margin)."""
    _, step, state = lora_step(PreferenceConfig(beta=0.1))
    (loss, out), grads = step.grads(state.params, ROWS)
    assert int(out["pairs"]) == 3
    assert abs(float(out["dpo_loss"]) - math.log(2)) <= 1e-6 and abs(float(out["rewards/margins"])) <= 1e-6
    adapters_b = [n for n in state.params if "lora_B" in n]
    assert adapters_b and any(float(np.abs(np.asarray(grads[n])).max()) > 0 for n in adapters_b)
    assert all(float(np.abs(v).max()) == 0 for n, v in reference_params({n: np.ones(3) for n in state.params}).items()
               if n in adapters_b)
    saved = {"model.embed_tokens.modules_to_save.default.weight": np.ones(2),
             "model.embed_tokens.original_module.weight": np.zeros(2)}        # peft's modules_to_save
    assert (reference_params(saved)["model.embed_tokens.modules_to_save.default.weight"] == 0).all()
    _, step, state = lora_step(IPO)
    out = jax.device_get(step.evaluate(state.params, ROWS))        # sums over the batch's pairs
    assert abs(float(out["dpo_loss"]) / 3 - 1 / (4 * IPO.beta ** 2)) <= 1e-6, float(out["dpo_loss"]) / 3


@pytest.mark.parametrize("cfg", [SIGMOID, IPO], ids=["sigmoid", "ipo"])
def test_lowered_dpo_step_matches_eager_torch(cfg):
    model, step = full_step(cfg)
    params = step.layer_layout.stack({n: p.detach().numpy() for n, p in model.named_parameters()})
    reference = perturbed_reference(step, params)
    (loss, out), grads = step.grads(params, {**ROWS, "reference": reference})
    model.zero_grad()
    eager_loss, eager_metrics = dpo_loss_eager(model, cfg, torch_batch(ROWS), torch.tensor(reference))
    eager_loss.backward()
    eager = float(eager_loss.detach())
    # The loss's inputs first (log-probabilities, rewards), so a failure names the stage at fault.
    for key, value in eager_metrics.items():
        assert abs(float(out[key]) - float(value)) <= 1e-5 * max(1.0, abs(float(value))), \
            (key, float(out[key]), float(value))
    bound = LOSS_BOUND.get(jax.default_backend(), 1e-5)
    assert abs(float(loss) - eager) <= bound * max(1.0, abs(eager)), (float(loss), eager, dict(eager_metrics))
    lowered = step.layer_params(grads)
    for name, p in model.named_parameters():
        assert rel_err(np.asarray(lowered[name]), p.grad.numpy()) <= 1e-4, (name, rel_err(np.asarray(lowered[name]),
                                                                                        p.grad.numpy()))


def test_micro_batches_give_the_big_batch_mean_over_pairs():
    """Rows of 2 and 1 pairs as two micro-batches: each micro-batch's pair sum over the step's 3
    pairs; the summed gradients equal the one-batch gradients (a mean of micro-batch means would
    weight the lone pair twice)."""
    model, step = full_step(SIGMOID)
    params = step.layer_layout.stack({n: p.detach().numpy() for n, p in model.named_parameters()})
    reference = perturbed_reference(step, params)
    whole = {**ROWS, "reference": reference}
    (_, _), big = step.grads(params, whole)
    grads_of = jax.jit(lambda p, t, d: step._grads(p, t, d, 0.5)[1])
    parts = [grads_of(params, step.place_batch({k: v[i:i + 1] for k, v in whole.items()}, 0), np.float32(3.0))
             for i in range(2)]
    for name in big:
        assert rel_err(np.asarray(parts[0][name] + parts[1][name]), np.asarray(big[name])) <= 1e-5, name


def test_dpo_steps_on_a_data_and_an_fsdp_mesh_equal_one_device():
    """Three steps on 2 simulated devices (tests/dpo_mesh_worker.py) give the one-device losses and
    parameters: full fine-tuning with the pairs split over `data` (the reference in the batch,
    split as the rows are) and LoRA with the parameters split over `fsdp` (the adapters-off
    reference)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from worker_env import worker_env

    worker = Path(__file__).with_name("dpo_mesh_worker.py")
    proc = subprocess.run([sys.executable, str(worker)], env=worker_env(), capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    runs = json.loads(lines[-1][len("RESULT "):])
    assert set(runs) == {"full@data=2", "lora@fsdp=2"}
    for name, r in runs.items():
        assert len(r["losses"]) == 3 and r["losses"][0] != r["losses"][-1], (name, r["losses"])
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["reference"])) < 1e-5, (name, r)
        assert r["param_rel_err"] < 1e-4, (name, r["param_rel_err"])
