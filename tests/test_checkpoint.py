"""train/checkpoint.py: round trip, validation errors that name the problem, atomic publication."""
import json

import pytest
import safetensors.torch
import torch

from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from train import checkpoint
from train.checkpoint import load_checkpoint, save_checkpoint
from train.errors import UserError

CFG = get_preset("tiny").replace(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                                 n_experts=2, experts_per_token=1, expert_dim=16, sliding_window=4)


@pytest.fixture(scope="module")
def state():
    torch.manual_seed(0)
    return GptOssForCausalLM(CFG).state_dict()


def leftovers(path):
    """Hidden temp/backup dirs the writer may have left beside `path`."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def write_raw(path, tensors, model_dict, **top):
    """A checkpoint written by hand, bypassing save_checkpoint's validation."""
    path.mkdir(parents=True)
    safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
    config = {"format": "torchlyra-checkpoint", "version": 1, "model": model_dict, "step": 3, **top}
    (path / "config.json").write_text(json.dumps(config))


def test_round_trip(tmp_path, state):
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG, step=12, extra={"kernels": {"attention": "reference"}})
    loaded, cfg, meta = load_checkpoint(ck)
    assert cfg == CFG
    assert meta["step"] == 12 and meta["kernels"] == {"attention": "reference"} and meta["format"] == "torchlyra-checkpoint"
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) and loaded[k].dtype == torch.float32 for k in state)
    assert leftovers(ck) == []
    (tmp_path / "plain").mkdir()   # published with the mode a plain mkdir gets, not mkdtemp's 0700
    assert ck.stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777


def test_bf16_state_is_stored_as_float32(tmp_path, state):
    ck = tmp_path / "ck"
    save_checkpoint(ck, {k: v.bfloat16() for k, v in state.items()}, CFG)
    loaded, _, _ = load_checkpoint(ck)
    assert all(loaded[k].dtype == torch.float32 and torch.equal(loaded[k], state[k].bfloat16().float()) for k in state)


def test_tokenizer_saved_inside_the_checkpoint(tmp_path, state):
    from train.data.tokenizer import load_tokenizer, train_bpe

    enc = train_bpe(["hello world, hello there\n"] * 20, 300)
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG, tokenizer=enc)
    _, _, meta = load_checkpoint(ck)
    assert meta["tokenizer"] == {"dir": "."}
    again = load_tokenizer(checkpoint.tokenizer_dir(ck, meta))
    assert again.encode("hello world") == enc.encode("hello world")


def test_replaces_a_previous_checkpoint_but_not_other_directories(tmp_path, state):
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG, step=1)
    save_checkpoint(ck, state, CFG, step=2)
    assert load_checkpoint(ck)[2]["step"] == 2
    with pytest.raises(UserError, match="overwrite"):
        save_checkpoint(ck, state, CFG, step=3, overwrite=False)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="no torchlyra checkpoint"):
        save_checkpoint(other, state, CFG)
    assert (other / "keep.txt").read_text() == "mine" and leftovers(other) == []


def test_replace_without_atomic_exchange(tmp_path, state, monkeypatch):
    monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)   # filesystems without renameat2
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG, step=1)
    save_checkpoint(ck, state, CFG, step=2)
    assert load_checkpoint(ck)[2]["step"] == 2 and leftovers(ck) == []


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, state, monkeypatch):
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG, step=1)
    real_save = safetensors.torch.save_file

    def crash(tensors, filename, metadata=None):
        real_save(dict(list(tensors.items())[:2]), filename, metadata)   # a partial file, then die
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    changed = {k: v + 1 for k, v in state.items()}
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(ck, changed, CFG, step=2)
    monkeypatch.undo()
    loaded, _, meta = load_checkpoint(ck)
    assert meta["step"] == 1 and all(torch.equal(loaded[k], state[k]) for k in state)
    assert leftovers(ck) == []
    # A first save that crashes leaves no directory at all.
    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path / "fresh", state, CFG)
    assert not (tmp_path / "fresh").exists() and leftovers(tmp_path / "fresh") == []


def test_stale_temp_dir_of_a_killed_writer_is_removed(tmp_path, state):
    stale = tmp_path / ".ck.tmp-killed"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
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
    ("dtype", r"tensor lm_head\.weight has dtype torch\.bfloat16, expected torch\.float32"),
    ("head_dim", r"field 'model'.*head_dim must be even.*15"),
    ("experts_per_token", r"field 'model'.*experts_per_token must be in 1\.\.n_experts \(2\), found 3"),
    ("layer_type", r"field 'model'.*unknown layer type 'local'"),
    ("unknown_field", r"field 'model'.*unknown ModelConfig field\(s\): n_embd"),
    ("version", r"field 'version' expected 1, found 2"),
    ("format", r"field 'format' expected 'torchlyra-checkpoint', found None.*torchlyra import"),
])
def test_load_errors_name_the_problem(tmp_path, state, case, expected):
    tensors = dict(state)
    model = CFG.to_dict()
    top = {}
    if case == "missing":
        del tensors["model.norm.weight"]
    elif case == "extra":
        tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(2, 32)
    elif case == "shape":
        tensors["lm_head.weight"] = torch.zeros(64, 16)
    elif case == "dtype":
        tensors["lm_head.weight"] = tensors["lm_head.weight"].bfloat16()
    elif case == "head_dim":
        model["head_dim"] = 15
    elif case == "experts_per_token":
        model["experts_per_token"] = 3
    elif case == "layer_type":
        model["layer_types"] = ["local", "full_attention"]
    elif case == "unknown_field":
        model["n_embd"] = 32
    ck = tmp_path / "ck"
    write_raw(ck, tensors, model, **top)
    if case == "version":
        cfg = json.loads((ck / "config.json").read_text())
        (ck / "config.json").write_text(json.dumps({**cfg, "version": 2}))
    if case == "format":   # a Hugging Face directory given where a checkpoint is expected
        (ck / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    with pytest.raises(UserError, match=expected):
        load_checkpoint(ck)


def test_load_errors_for_missing_files(tmp_path, state):
    with pytest.raises(UserError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"config\.json: expected a torchlyra checkpoint config, found no file"):
        load_checkpoint(tmp_path / "empty")
    ck = tmp_path / "ck"
    save_checkpoint(ck, state, CFG)
    (ck / "model.safetensors").unlink()
    with pytest.raises(UserError, match=r"model\.safetensors: expected the checkpoint's weights, found no file"):
        load_checkpoint(ck)
    (ck / "model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(UserError, match="unreadable safetensors"):
        load_checkpoint(ck)
    (ck / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_checkpoint(ck)
