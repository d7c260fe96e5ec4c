"""formats/checkpoint.py format level: parameters-only round trip (what `import` writes and every
consumer reads), atomic publication, and load errors that name the problem."""
import json

import numpy as np
import pytest
import torch

from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from formats import atomic, checkpoint
from formats.checkpoint import load_checkpoint, save_checkpoint
from formats.atomic import sha256_file
from formats.checkpoint_integrity import MANIFEST_FILE, write_manifest
from formats.errors import UserError

CFG = get_preset("tiny").replace(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                                 n_experts=2, experts_per_token=1, expert_dim=16, sliding_window=4)


@pytest.fixture(scope="module")
def state():
    torch.manual_seed(0)
    return GptOssForCausalLM(CFG).state_dict()


def leftovers(path):
    """Hidden temp/backup dirs the writer may have left beside `path`."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def write_raw(path, tensors: dict, model_dict: dict, **meta):
    """A checkpoint written straight through the Orbax writer, bypassing save_checkpoint's checks."""
    import jax.numpy as jnp

    writer = checkpoint.CheckpointWriter(path, keep=1)
    writer.save(3, {"params": {k: jnp.asarray(v.numpy()) for k, v in tensors.items()}}, {"model": model_dict, **meta})
    writer.close()


def test_round_trip(tmp_path, state):
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG, step=12, extra={"kernels": {"attention": "reference"}})
    loaded, cfg, meta = load_checkpoint(ck)
    assert cfg == CFG
    assert meta["step"] == 12 and meta["kernels"] == {"attention": "reference"} and meta["format"] == "torchlyra-checkpoint"
    assert meta["version"] == 2 and meta["contents"] == "params" and meta["layout"] == "per_layer"
    assert meta["step_dir"] == str((ck / "12").resolve())
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) and loaded[k].dtype == torch.float32 for k in state)
    assert leftovers(ck) == []
    assert load_checkpoint(ck / "12")[2]["step"] == 12                   # a step directory reads the same
    (tmp_path / "plain").mkdir()   # published with the mode a plain mkdir gets, not mkdtemp's 0700
    assert ck.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777


def test_relative_paths_work(tmp_path, state, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_checkpoint("runs/ck", state, CFG, step=4)
    assert load_checkpoint("runs/ck")[2]["step"] == 4 and load_checkpoint("runs/ck/4")[2]["step"] == 4


def test_bf16_state_is_stored_as_float32(tmp_path, state):
    ck = tmp_path / "ck"
    save_checkpoint(ck, {k: v.bfloat16() for k, v in state.items()}, CFG)
    loaded, _, _ = load_checkpoint(ck)
    assert all(loaded[k].dtype == torch.float32 and torch.equal(loaded[k], state[k].bfloat16().float()) for k in state)


def test_tokenizer_saved_inside_the_checkpoint(tmp_path, state):
    from formats.tokenizer import load_tokenizer, train_bpe

    enc = train_bpe(["hello world, hello there\n"] * 20, 300)
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG, tokenizer=enc)
    _, _, meta = load_checkpoint(ck)
    assert meta["tokenizer"] == {"dir": "tokenizer", "name": enc.name}
    again = load_tokenizer(checkpoint.tokenizer_dir(ck, meta))
    assert again.encode("hello world") == enc.encode("hello world")


def test_every_file_is_in_the_hash_manifest(tmp_path, state):
    save_checkpoint(tmp_path / "ck", state, CFG)
    step_dir = tmp_path / "ck" / "0"
    listed = json.loads((step_dir / MANIFEST_FILE).read_text())["files"]
    on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()} - {MANIFEST_FILE}
    assert set(listed) == on_disk and any(name.startswith("state/") for name in listed)
    assert all(set(entry) == {"bytes", "xxh3_128"} for entry in listed.values())
    # A manifest written before (sha256 per file) verifies as it is.
    older = {rel: {"bytes": e["bytes"], "sha256": sha256_file(step_dir / rel)} for rel, e in listed.items()}
    (step_dir / MANIFEST_FILE).write_text(json.dumps({"format": "torchlyra-checkpoint-manifest", "version": 1,
                                                       "files": older}))
    load_checkpoint(tmp_path / "ck" / "0")
    (step_dir / "meta" / "metadata").write_text((step_dir / "meta" / "metadata").read_text().replace('"step": 0', '"step": 9'))
    with pytest.raises(UserError, match=r"is damaged: file meta/metadata fails its checksum \(sha256: altered"):
        load_checkpoint(tmp_path / "ck" / "0")
    write_manifest(step_dir)
    (step_dir / "meta" / "metadata").write_text((step_dir / "meta" / "metadata").read_text().replace('"step": 9', '"step": 8'))
    with pytest.raises(UserError, match=r"is damaged: file meta/metadata fails its checksum \(xxh3_128: altered"):
        load_checkpoint(tmp_path / "ck" / "0")


def test_replaces_a_previous_checkpoint_but_not_other_directories(tmp_path, state):
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG, step=1)
    save_checkpoint(ck, state, CFG, step=2)
    assert load_checkpoint(ck)[2]["step"] == 2 and [s for s, _ in checkpoint.step_dirs(ck)] == [2]
    with pytest.raises(UserError, match="overwrite"):
        save_checkpoint(ck, state, CFG, step=3, overwrite=False)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="no torchlyra checkpoint"):
        save_checkpoint(other, state, CFG)
    assert (other / "keep.txt").read_text() == "mine" and leftovers(other) == []


def test_replace_without_atomic_exchange(tmp_path, state, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)   # filesystems without renameat2
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG, step=1)
    save_checkpoint(ck, state, CFG, step=2)
    assert load_checkpoint(ck)[2]["step"] == 2 and leftovers(ck) == []


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, state, monkeypatch):
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG, step=1)

    def crash(step_dir):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "write_manifest", crash)
    changed = {k: v + 1 for k, v in state.items()}
    with pytest.raises(Exception, match="disk full"):
        save_checkpoint(ck, changed, CFG, step=2)
    monkeypatch.undo()
    loaded, _, meta = load_checkpoint(ck)
    assert meta["step"] == 1 and all(torch.equal(loaded[k], state[k]) for k in state)
    assert leftovers(ck) == []


def test_stale_temp_dir_of_a_killed_writer_is_removed(tmp_path, state):
    stale = tmp_path / ".ck.tmp-killed"
    stale.mkdir()
    (stale / "partial").write_bytes(b"partial")
    save_checkpoint(tmp_path / "ck", state, CFG)
    assert not stale.exists()


def test_save_rejects_state_that_does_not_match_config(tmp_path, state):
    bad = dict(state)
    del bad["model.layers.1.self_attn.sinks"]
    with pytest.raises(UserError, match=r"model\.layers\.1\.self_attn\.sinks is missing"):
        save_checkpoint(tmp_path / "ck", bad, CFG)
    assert not (tmp_path / "ck").exists() and leftovers(tmp_path / "ck") == []
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path / "ck", state, CFG, extra={"step": 5})


@pytest.mark.parametrize("case, expected", [
    ("missing", r"tensor model\.norm\.weight is missing \(expected shape \[32\]\)"),
    ("extra", r"unexpected tensor model\.layers\.0\.mlp\.gate\.weight of shape \[2, 32\]"),
    ("shape", r"tensor lm_head\.weight has shape \[64, 16\], expected \[64, 32\]"),
    ("dtype", r"tensor lm_head\.weight has dtype float16, expected one of float32, bfloat16"),
    ("head_dim", r"field 'model'.*head_dim must be even.*15"),
    ("experts_per_token", r"field 'model'.*experts_per_token must be in 1\.\.n_experts \(2\), found 3"),
    ("layer_type", r"field 'model'.*unknown layer type 'local'"),
    ("unknown_field", r"field 'model'.*unknown ModelConfig field\(s\): n_embd"),
    ("layout", r"field 'layout' is 'diagonal'; this version reads \['grouped', 'per_layer', 'stacked'\]"),
])
def test_load_errors_name_the_problem(tmp_path, state, case, expected):
    tensors = dict(state)
    model = CFG.to_dict()
    meta = {}
    if case == "missing":
        del tensors["model.norm.weight"]
    elif case == "extra":
        tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(2, 32)
    elif case == "shape":
        tensors["lm_head.weight"] = torch.zeros(64, 16)
    elif case == "dtype":
        tensors["lm_head.weight"] = tensors["lm_head.weight"].half().float()
    elif case == "head_dim":
        model["head_dim"] = 15
    elif case == "experts_per_token":
        model["experts_per_token"] = 3
    elif case == "layer_type":
        model["layer_types"] = ["local", "full_attention"]
    elif case == "unknown_field":
        model["n_embd"] = 32
    elif case == "layout":
        meta["layout"] = "diagonal"
    if case == "dtype":
        import jax.numpy as jnp
        writer = checkpoint.CheckpointWriter(tmp_path / "ck", keep=1)
        params = {k: jnp.asarray(v.numpy()) for k, v in tensors.items()}
        params["lm_head.weight"] = params["lm_head.weight"].astype(jnp.float16)
        writer.save(3, {"params": params}, {"model": model})
        writer.close()
    else:
        write_raw(tmp_path / "ck", tensors, model, **meta)
    with pytest.raises(UserError, match=expected):
        load_checkpoint(tmp_path / "ck")


def test_load_errors_for_missing_files_and_other_formats(tmp_path, state):
    with pytest.raises(UserError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"no torchlyra checkpoint here \(expected a run directory"):
        load_checkpoint(tmp_path / "empty")
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "config.json").write_text(json.dumps({"format": "torchlyra-checkpoint", "version": 1}))
    with pytest.raises(UserError, match=r"a version-1 torchlyra checkpoint .* no longer reads; expected version 2"):
        load_checkpoint(v1)
    (v1 / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    with pytest.raises(UserError, match=r"a Hugging Face model directory.*torchlyra import --hf"):
        checkpoint.find_checkpoint(v1)      # export and resume take torchlyra checkpoints only
    with pytest.raises(UserError, match=r"v1: expected model.safetensors or model.safetensors.index.json, found neither"):
        load_checkpoint(v1)                 # generate / eval / parity read it directly: no weights here
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG)
    (ck / "0" / "meta" / "metadata").write_text("{not json")
    with pytest.raises(UserError, match=r"no complete checkpoint \(checkpoint .* is damaged: file meta/metadata"):
        load_checkpoint(ck)


def test_params_checkpoint_cannot_be_resumed(tmp_path, state):
    save_checkpoint(tmp_path / "ck", state, CFG)
    with pytest.raises(UserError, match=r"holds parameters only .* --init-from"):
        checkpoint.restore_train_state(tmp_path / "ck" / "0", {"params": {}})
    assert np.isfinite(load_checkpoint(tmp_path / "ck")[0]["lm_head.weight"].numpy()).all()
