"""The one loader (formats/mesh_loader.py): our checkpoints read by slice in every stored layout,
a base on `meta` adapted by peft with the adapters a host base gets, and the train state it
places equal to the one built from a whole host model (LoRA, --freeze, full; layers scanned or
looped), the trainer's host model never holding the base."""
import json
import threading

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

from formats import checkpoint, mesh_loader
from formats.checkpoint_weights import CheckpointWeights, open_weights
from formats.model_checks import build_model
from jax_bridge.layer_stack import LayerLayout
from jax_bridge.step import StepConfig, TrainStep
from torch_model.config import get_preset
from torch_model.freeze import freeze_parameters
from torch_model.lora import apply_lora, base_parameter_of, parse_lora_spec

CFG = get_preset("tiny").replace(n_layers=4, vocab_size=320, d_model=64, n_heads=2, n_kv_heads=1, head_dim=32,
                                 n_experts=4, expert_dim=32, sliding_window=8, max_seq_len=16)
LORA = "r=2,alpha=4,targets=all-linear+experts,modules_to_save=lm_head"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(random state, a per-layer checkpoint of it, the same stored stacked as a train run's, and
    stacked with zstd as checkpoints were written before: each stack one compressed chunk)."""
    root = tmp_path_factory.mktemp("loader")
    torch.manual_seed(0)
    state = {n: torch.randn(p.shape) * 0.05 for n, p in build_model(CFG).named_parameters()}
    checkpoint.save_checkpoint(root / "per_layer", state, CFG)
    layout = LayerLayout.for_config(CFG, stacked=True)
    stacked = layout.stack({n: v.numpy() for n, v in state.items()})
    for name, compress in (("stacked", False), ("stacked_zstd", True)):
        writer = checkpoint.CheckpointWriter(root / name, keep=1, compress=compress)
        writer.save(0, {"params": {n: jax.numpy.asarray(v) for n, v in stacked.items()}},
                    {"model": CFG.to_dict(), "layout": layout.tag}, None)
        writer.close()
    return state, root


@pytest.mark.parametrize("stored", ["per_layer", "stacked", "stacked_zstd"])
def test_checkpoint_weights_read_any_slice_of_any_layout_reading_only_it(base, stored):
    state, root = base
    _, meta, weights = open_weights(root / stored)
    assert meta["layout"] == ("per_layer" if stored == "per_layer" else LayerLayout.for_config(CFG, True).tag)
    assert {n: tuple(e.shape) for n, e in weights.entries.items()} == {n: tuple(v.shape) for n, v in state.items()}
    rng = np.random.default_rng()
    for name in ["model.layers.3.mlp.experts.gate_up_proj", "model.layers.1.self_attn.sinks", "lm_head.weight"]:
        shape = state[name].shape
        index = tuple(slice(int(a), int(b) + 1) for a, b in
                      (sorted(rng.integers(0, n, 2)) for n in shape))
        before = weights.bytes_requested
        got = weights.read(name, index)
        np.testing.assert_array_equal(got, state[name].numpy()[index])
        assert weights.bytes_requested - before == got.nbytes      # the slice, not the tensor
        narrow = np.empty(got.shape, ml_dtypes.bfloat16)          # a block in bf16 (TPU's compute dtype)
        weights.read_into(name, index, narrow)
        np.testing.assert_array_equal(narrow, got.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("stored", ["stacked", "stacked_zstd"])
def test_placing_a_model_reads_each_stored_chunk_once(base, stored, monkeypatch):
    """generate places a model's parameters under their per-layer names (layer 0's, then layer
    1's, ...). Uncompressed (what we write), each is one tensorstore read of its slice, several
    at once on the loader's threads; from a zstd checkpoint, whose stacks are each one chunk that
    any read decodes whole, the loader reads each stored array once (its reads grouped by it, one
    at a time) and lets go of it after."""
    state, root = base
    _, _, weights = open_weights(root / stored)
    threads = set()
    real = CheckpointWeights.read_into
    monkeypatch.setattr(CheckpointWeights, "read_into", lambda self, *args: threads.add(
        threading.current_thread().name.split("_")[0]) or real(self, *args))
    model = build_model(CFG, meta=True)
    abstract = {n: jax.ShapeDtypeStruct(p.shape, np.float32) for n, p in model.named_parameters()}
    placed = mesh_loader.place_model(model, weights, abstract, None)
    for name, value in placed.items():
        np.testing.assert_array_equal(np.asarray(value), state[name].numpy(), err_msg=name)
    stored_arrays = {weights.stored_key(n) for n in state}
    assert len(stored_arrays) < len(state)               # a stack: one stored array for several layers
    assert weights.reads == (len(state) if stored == "stacked" else len(stored_arrays))
    assert weights._held is None
    assert threads == ({"torchlyra-read"} if stored == "stacked" else {"MainThread"}), threads


def test_a_meta_base_gets_the_adapters_a_host_base_gets_and_stays_on_meta():
    spec = parse_lora_spec(LORA)
    torch.manual_seed(1)
    host = build_model(CFG)
    torch.manual_seed(7)
    apply_lora(host, spec)
    meta = build_model(CFG, meta=True)
    torch.manual_seed(7)
    apply_lora(meta, spec)
    host_params, meta_params = dict(host.named_parameters()), dict(meta.named_parameters())
    assert host_params.keys() == meta_params.keys()
    adapters = [n for n in meta_params if base_parameter_of(n)[1] is not None]
    assert len(adapters) == 4 * (4 + 2) * 2          # 4 layers x (q, k, v, o, gate_up, down) x (A, B)
    for name, p in meta_params.items():
        if name in adapters:
            torch.testing.assert_close(p, host_params[name], rtol=0, atol=0)
        else:       # the base, and peft's trained copy of the head: no values on the host
            assert p.is_meta, name


def adapted(spec: str | None, freeze: list[str] | None, state: dict | None = None):
    """The model as a run adapts it: built on the host holding `state`, or on `meta` (None)."""
    if state is None:
        model = build_model(CFG, meta=True)
    else:
        torch.manual_seed(0)
        model = build_model(CFG)
        model.load_state_dict(state)
    torch.manual_seed(7)
    if spec:
        apply_lora(model, parse_lora_spec(spec))
    if freeze:
        freeze_parameters(model, freeze)
    return model


def host_built(spec: str | None, freeze: list[str] | None, scan: bool, state: dict):
    """The train state and frozen parameters made the old way: the whole model on the host."""
    step = TrainStep(adapted(spec, freeze, state), step_cfg=StepConfig(scan_layers=scan))
    return step.init_state(), step.frozen


def streamed(spec: str | None, freeze: list[str] | None, scan: bool, path):
    step = TrainStep(adapted(spec, freeze), step_cfg=StepConfig(scan_layers=scan))
    _, _, weights = mesh_loader.open_weights(path)
    return mesh_loader.init_state(step, weights), step.frozen, weights


@pytest.mark.parametrize("spec,freeze,scan,stored", [
    (LORA, None, True, "stacked"),
    ("r=4,alpha=8,targets=attention", None, False, "per_layer"),
    (None, ["*.embed_tokens.*", "*.self_attn.*"], True, "per_layer"),
    (None, None, False, "stacked"),
])
def test_the_streamed_state_equals_the_one_built_from_a_host_model(base, spec, freeze, scan, stored, monkeypatch):
    """Read in pieces of at most 4 KiB (mesh_loader.READ_BYTES) along the leading axis: no read
    returns more than that or one row along it."""
    state, root = base
    monkeypatch.setattr(mesh_loader, "READ_BYTES", 4096)
    reads = []          # the blocks' parts each read fills
    real = CheckpointWeights.read_into
    monkeypatch.setattr(CheckpointWeights, "read_into", lambda self, name, index, out: reads.append(out) or
                        real(self, name, index, out))
    (want, want_frozen) = host_built(spec, freeze, scan, state)
    got, got_frozen, weights = streamed(spec, freeze, scan, root / stored)
    row = max(4 * int(np.prod(v.shape[1:])) for v in state.values())
    assert max(r.nbytes for r in reads) <= max(4096, row) and len(reads) > 2 * len(state)
    assert got.params.keys() == want.params.keys() and got_frozen.keys() == want_frozen.keys()
    for name in want.params:
        assert got.params[name].dtype == want.params[name].dtype, name
        np.testing.assert_array_equal(np.asarray(got.params[name]), np.asarray(want.params[name]), err_msg=name)
    for name in want_frozen:
        assert got_frozen[name].dtype == want_frozen[name].dtype, name
        np.testing.assert_array_equal(np.asarray(got_frozen[name]), np.asarray(want_frozen[name]), err_msg=name)
    for a, b in zip(jax.tree.leaves(got.opt_state), jax.tree.leaves(want.opt_state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Each base tensor read once per parameter made of it (peft's trained head copy: twice).
    read = [base_parameter_of(n) for n, _ in adapted(spec, freeze).named_parameters()]
    assert weights.bytes_requested == 4 * sum(state[name].numel() for name, role in read if role is None)


def test_a_base_missing_a_tensor_is_named(base, tmp_path):
    state, _ = base
    step = TrainStep(build_model(CFG, meta=True), step_cfg=StepConfig(scan_layers=False))
    cfg_missing = {n: v for n, v in state.items() if n != "model.norm.weight"}
    weights = type("Weights", (), {"entries": {n: type("E", (), {"shape": v.shape}) for n, v in cfg_missing.items()},
                                   "read": None, "bytes_requested": 0})()
    with pytest.raises(Exception, match="model.norm.weight .* is missing"):
        mesh_loader.init_state(step, weights, where="--init-from X")


def test_lora_training_from_a_checkpoint_keeps_the_base_off_the_host(base, tmp_path):
    """`train --init-from CK --lora`: the trainer's torch model holds adapters only; the base is
    on the devices, in the compute dtype, equal to the checkpoint's."""
    from helpers import prepare_play_corpus
    from train.run.config import TrainConfig
    from train.run.trainer import Trainer

    state, root = base
    prepare_play_corpus(tmp_path)
    cfg = TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "run"), init_from=str(root / "stacked"),
                      lora=LORA, seq_len=16, batch_size=2, steps=1, samples=0, eval_batches=1)
    trainer = Trainer(cfg, show_progress=False)
    try:
        for name, p in trainer.model.named_parameters():
            assert p.is_meta == (base_parameter_of(name)[1] is None), name
        frozen = trainer.step.layer_layout.unstack(trainer.step.frozen)
        for name, value in frozen.items():
            np.testing.assert_array_equal(np.asarray(value), state[base_parameter_of(name)[0]].numpy(), err_msg=name)
        json.dumps(trainer.base_reference)
        assert trainer.base_reference["path"].endswith("/0")
    finally:
        trainer.close()


def test_samples_and_task_scores_of_a_lora_run_gather_no_parameters(base, tmp_path, monkeypatch):
    """The end-of-run samples and the periodic task scores are computed where the parameters are
    (the compiled decoder and scorer): what comes back to the host is tokens and scores, far
    less than one layer's weights, on a run whose base never left its files for the host."""
    from helpers import prepare_play_corpus
    from jax_bridge import sharding
    from train.run.config import TrainConfig
    from train.run.loop import run_training

    state, root = base
    prepare_play_corpus(tmp_path)
    tasks = tmp_path / "plays.jsonl"
    tasks.write_text("".join(json.dumps({"context": f"{who}:", "choices": ["But soft", "O Romeo"], "gold": i}) + "\n"
                             for i, who in enumerate(["ROMEO", "JULIET"])))
    gathered = []
    real = sharding.to_host

    def recording(tree):
        out = real(tree)
        gathered.append(sum(np.asarray(x).nbytes for x in jax.tree.leaves(out)))
        return out

    monkeypatch.setattr(sharding, "to_host", recording)
    cfg = TrainConfig(data=str(tmp_path / "data"), out=str(tmp_path / "run"), init_from=str(root / "per_layer"),
                      lora="r=2,alpha=4,targets=attention", seq_len=16, batch_size=2, steps=2, eval_every=2,
                      eval_batches=1, eval_tasks=str(tasks), samples=1, sample_tokens=4, checkpoint_every=2)
    summary = run_training(cfg, show_progress=False)
    assert len(summary["samples"]) == 1 and summary["samples"][0]["text"].startswith("ROMEO:")
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "eval"]
    assert [set(r["tasks"]) for r in evals] == [{"plays"}, {"plays"}]
    assert gathered and max(gathered) < state["model.layers.0.self_attn.q_proj.weight"].numel() * 4


def test_parity_refuses_a_checkpoint_whose_eager_reference_would_not_fit_this_host(base, monkeypatch, capsys):
    """Parity's ground truth is the whole model in float32 on one host: a checkpoint too large for
    this host is refused in one line naming the need, what the host has and what to do instead."""
    from parity import run as parity_run
    from train.cli import main

    state, root = base
    weights = 4 * sum(v.numel() for v in state.values())
    monkeypatch.setattr(parity_run, "available_host_bytes", lambda: parity_run.HOST_COPIES * weights - 1)
    assert main(["parity", "--checkpoint", str(root / "per_layer")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds the whole model in float32 on this host" in err, err
    assert "parity compares models that fit one host" in err and "with `eval`" in err
    monkeypatch.setattr(parity_run, "available_host_bytes", lambda: parity_run.HOST_COPIES * weights)
    parity_run.check_fits_host(root / "per_layer")          # just fits: no error


@pytest.mark.parametrize("alias", [True, False])
def test_blocks_of_undonated_arrays_become_the_device_buffers(alias, monkeypatch):
    """place(alias=True) (inference parameters, a frozen base): each block the loader fills is
    the CPU device's buffer, held once. alias=False (trained, donated arrays) makes no promise: the
    device copies a block unless malloc happened to align it. The values are the source's either way."""
    import types

    values = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)     # 256 KiB: malloc maps it, 16-byte aligned
    source = types.SimpleNamespace(read=lambda name, index: values[index])
    blocks = []
    empty = mesh_loader._empty
    monkeypatch.setattr(mesh_loader, "_empty", lambda *a: blocks.append(empty(*a)) or blocks[-1])
    abstract = {"w": jax.ShapeDtypeStruct(values.shape, np.float32)}
    placed = mesh_loader.place(source, abstract, {"w": "w"}, None, alias=alias)["w"]
    assert np.array_equal(np.asarray(placed), values) and len(blocks) == 1
    if alias:
        assert blocks[0].ctypes.data % 64 == 0 and np.shares_memory(np.asarray(placed), blocks[0])
