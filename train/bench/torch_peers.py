"""The PyTorch contenders of `torchlyra bench step`, and the child process that times them.

torch.compile cannot run in a process that has imported torchax ("PyTorch is not linked with
support for jax devices"), so this module imports no JAX: `python -m train.bench.torch_peers` reads a
JSON spec on stdin, builds its contenders, then times one round per "round" line it is sent and
answers each with one JSON line on its original stdout (everything else it prints goes to stderr).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# name -> what it is (the table's legend)
TORCH_PEERS = {
    "eager": "our torch model (a --module: the module's own forward and loss), eager, + the same Muon+AdamW",
    "compiled": "torch.compile of `eager` (model and optimizer step)",
    "hf": "transformers GptOssForCausalLM, eager, + torch.optim.AdamW",
    "hf_compiled": "torch.compile of `hf` (model and optimizer step)",
}
KINDS = ("fwdbwd", "step")


def bench_tokens(vocab_size: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    """The benchmark batch [batch, seq_len + 1], int32: the same in every process."""
    return np.random.default_rng(seed).integers(0, vocab_size, size=(batch, seq_len + 1), dtype=np.int32)


class TorchContender:
    """One model + optimizer. `run(kind)` times one forward+backward ("fwdbwd") or one full
    step ("step": forward, backward, optimizer step); gradients are dropped after each."""

    def __init__(self, name: str, model, optimizer, loss_fn, device: str, autocast_dtype=None, compile_backend=None):
        self.name, self.model, self.optimizer, self.device = name, model, optimizer, device
        self.loss_fn = loss_fn
        self.autocast_dtype = autocast_dtype
        self.opt_step = optimizer.step
        if compile_backend:
            self.loss_fn = torch.compile(loss_fn, backend=compile_backend)
            self.opt_step = torch.compile(optimizer.step, backend=compile_backend)

    def _sync(self):
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _fwd_bwd(self):
        if self.autocast_dtype is not None:
            with torch.autocast(self.device.split(":")[0], dtype=self.autocast_dtype):
                loss = self.loss_fn()
        else:
            loss = self.loss_fn()
        loss.backward()
        return loss

    def run(self, kind: str) -> float:
        self._sync()
        start = time.perf_counter()
        self._fwd_bwd()
        if kind == "step":
            self.opt_step()
        self._sync()
        seconds = time.perf_counter() - start
        self.optimizer.zero_grad(set_to_none=True)
        return seconds


def build_torch_contender(name: str, cfg, tokens: np.ndarray, *, opt_cfg=None, device: str = "cpu",
                          autocast_dtype=None, compile_backend: str = "inductor", seed: int = 0) -> TorchContender:
    """A contender of TORCH_PEERS on `device`, its weights our model's init at `seed`."""
    from torch_model.model import GptOssForCausalLM
    from torch_model.optim import MuonAdamW, OptimizerConfig

    if name not in TORCH_PEERS:
        raise ValueError(f"unknown torch contender {name!r}; choose from {', '.join(TORCH_PEERS)}")
    opt_cfg = opt_cfg or OptimizerConfig()
    ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    backend = compile_backend if name.endswith("compiled") else None
    torch.manual_seed(seed)
    if hasattr(cfg, "facts"):         # a module: as its author runs it (ModuleCausalLM.reference_twin)
        from torch_model.module_lm import ModuleCausalLM, instantiate

        if name.startswith("hf"):
            raise ValueError(f"{name}: transformers' GptOss is no peer of a module")
        model = ModuleCausalLM(instantiate(cfg.spec, cfg.args), cfg.facts, cfg.max_seq_len, truth=True)
        model = model.to(device).train()
        optimizer = MuonAdamW(model, opt_cfg)
        return TorchContender(name, model, optimizer, lambda: model(inputs, labels)["loss"], device, autocast_dtype,
                              backend)
    ours = GptOssForCausalLM(cfg)
    ours.reset_parameters(seed)
    if name in ("eager", "compiled"):
        model = ours.to(device).train()
        optimizer = MuonAdamW(model, opt_cfg)
        loss_fn = lambda: model(inputs, labels)["loss"]     # noqa: E731
    else:
        from formats import hf_mapping
        from transformers import GptOssForCausalLM as HFModel

        model = HFModel(hf_mapping.build_hf_config(cfg, attn_implementation="eager"))
        model.load_state_dict(hf_mapping.to_hf_state(ours.state_dict(), cfg), strict=True)
        model = model.to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg.adam_lr, betas=opt_cfg.adam_betas,
                                      eps=opt_cfg.eps, weight_decay=opt_cfg.adam_weight_decay)

        def loss_fn():   # the same next-token loss over the same positions as ours
            logits = model(input_ids=inputs, use_cache=False).logits
            return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    return TorchContender(name, model, optimizer, loss_fn, device, autocast_dtype, backend)


def warm_up(contender: TorchContender) -> dict:
    """Seconds of the first call of each kind (compiles, for compiled contenders) and of a second,
    untimed one after it."""
    out = {}
    for kind in KINDS:
        out[f"first_{kind}_s"] = contender.run(kind)
        contender.run(kind)
    return out


SETTLE_S = 0.2   # pause before each timed call: the other runtime's spinning worker threads go to sleep


def settled(run, *args) -> float:
    time.sleep(SETTLE_S)
    return run(*args)


def time_round(contenders: dict) -> dict:
    """{name: {kind: seconds}}: each contender's kinds timed once, in order."""
    return {name: {kind: settled(c.run, kind) for kind in KINDS} for name, c in contenders.items()}


# ---- the child process --------------------------------------------------------------------------
def child_main() -> int:
    """Serve the parent: spec on the first stdin line, then "round" lines, then "quit"."""
    from torch_model.config import ModelConfig
    from torch_model.module_lm import ModuleSpec
    from torch_model.optim import OptimizerConfig

    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr          # library chatter must not reach the protocol channel
    spec = json.loads(sys.stdin.readline())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    cfg = (ModuleSpec.from_dict(spec["model"], "bench step") if ModuleSpec.is_spec_dict(spec["model"])
           else ModelConfig.from_dict(spec["model"]))
    tokens = bench_tokens(cfg.vocab_size, spec["batch_size"], spec["seq_len"], spec["seed"])
    autocast = getattr(torch, spec["autocast_dtype"]) if spec.get("autocast_dtype") else None
    contenders, compile_info = {}, {}
    try:
        for name in spec["peers"]:
            print(f"bench step (child): building and warming up {name}", file=sys.stderr, flush=True)
            contenders[name] = build_torch_contender(name, cfg, tokens, opt_cfg=OptimizerConfig(**spec["optimizer"]),
                                                     device=spec["device"], autocast_dtype=autocast,
                                                     compile_backend=spec["compile_backend"], seed=spec["seed"])
            compile_info[name] = warm_up(contenders[name])
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails loudly
        answer.write(json.dumps({"error": f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[0][:400]}"}) + "\n")
        return 1
    answer.write(json.dumps({"ready": compile_info, "threads": torch.get_num_threads(),
                             "torch": torch.__version__}) + "\n")
    for line in sys.stdin:
        if line.strip() != "round":
            break
        answer.write(json.dumps({"times": time_round(contenders)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
