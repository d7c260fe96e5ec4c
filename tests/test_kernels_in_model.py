"""A full train step of `tiny` with every op on its Pallas kernel (interpret mode on CPU)
matches the `xla` step: loss, every gradient, and the parameters after the update. Small tiles
set through StepConfig.kernel_options make the sequence span several blocks of every kernel."""
import numpy as np
import torch

from helpers import rel_err
from jax_bridge.step import StepConfig, TrainStep
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM


def test_all_pallas_train_step_matches_xla_step():
    """Two layers (one sliding, one full attention) exercise every kernel: the interpreted Pallas
    kernels cost the suite ~1 minute at tiny's four."""
    torch.manual_seed(0)
    cfg = get_preset("tiny").replace(sliding_window=16, n_layers=2)
    model = GptOssForCausalLM(cfg)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 2, 81)).astype(np.int32)
    xla = TrainStep(model, step_cfg=StepConfig(kernels="xla"))
    small_tiles = ("attention.pallas.block_q=16,attention.pallas.block_kv=32,cross_entropy.pallas.block_n=32,"
                   "cross_entropy.pallas.block_v=1024,moe.pallas.block_m=16,moe.pallas.block_i=128")
    pallas = TrainStep(model, step_cfg=StepConfig(kernels="attention=pallas,cross_entropy=pallas,moe=pallas",
                                                  kernel_options=small_tiles))
    assert pallas.kernels == {"attention": "pallas", "cross_entropy": "pallas", "moe": "pallas"}
    params = xla.init_state().params
    (loss_x, _), grads_x = xla.grads(params, tokens[0])
    (loss_p, _), grads_p = pallas.grads(params, tokens[0])
    assert rel_err(loss_p, loss_x) < 1e-5
    errors = {n: rel_err(grads_p[n], grads_x[n]) for n in grads_x}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, f"gradient of {worst}: rel err {errors[worst]:.2e}"
    state_x, metrics_x = xla(xla.init_state(), tokens)
    state_p, metrics_p = pallas(pallas.init_state(), tokens)
    assert rel_err(metrics_p["loss"], metrics_x["loss"]) < 1e-5
    names = list(state_x.params)
    flat = lambda s: np.concatenate([np.asarray(s.params[n], np.float64).ravel() for n in names])
    assert rel_err(flat(state_p), flat(state_x)) < 1e-5
