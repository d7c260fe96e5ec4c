"""Export to / import from transformers' GptOss: loading without missing keys, logit parity,
sharding, bf16, tokenizer, bit-exact round trips, and errors that name the problem."""
import argparse
import json

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from formats import hf_export, hf_import, hf_mapping
from formats.hf_export import export_checkpoint
from formats.hf_import import import_hf
from parity.hf_parity import compare_with_transformers
from torch_model.config import get_preset
from torch_model.model import GptOssForCausalLM
from formats.checkpoint import load_checkpoint, save_checkpoint
from formats.errors import UserError

transformers = pytest.importorskip("transformers")

TINY = get_preset("tiny").replace(vocab_size=512, bos_token_id=511, eos_token_id=511)
# Different heads/experts/window: 8 query heads on one KV head, 4 experts top-1, window 5.
ALT = get_preset("tiny").replace(vocab_size=512, d_model=64, n_layers=3, n_heads=8, n_kv_heads=1, head_dim=16,
                                 n_experts=4, experts_per_token=1, expert_dim=32, sliding_window=5,
                                 rope_theta=10000.0, rope_scaling_factor=4.0, rope_original_max_position=64,
                                 max_position_embeddings=256)   # = factor x original, as transformers expects
DENSE = get_preset("dense").replace(vocab_size=512, d_model=64, dense_dim=96, n_layers=2, sliding_window=6)
SMALL = ALT.replace(n_layers=2)     # for the error cases: cheapest valid model
SAMPLES = ["Hello, world! The quick brown fox jumps over the lazy dog 12345.\n",
           "naïve café — ünïcödé ЖЖЖ 日本語 😀\ttabs  and   spaces\r\n\r\n", "<|bos|>once upon a time",
           "def f(x):\n    return [x ** 2 for x in range(10)]  # comment\n", "'s 're I'LL don't 3.14159 1000000"]


def random_state(cfg, seed=0):
    """Every tensor random (biases, sinks and router too), so a wrong mapping cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in GptOssForCausalLM(cfg).state_dict().items():
        noise = torch.randn(t.shape, generator=gen)
        out[name] = 1 + 0.1 * noise if name.endswith("norm.weight") else 0.05 * noise
    return out


def leftovers(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


@pytest.fixture(scope="module")
def enc():
    from formats.tokenizer import train_bpe
    corpus = SAMPLES * 20 + [open(hf_export.__file__).read(), open(hf_mapping.__file__).read()]
    return train_bpe(corpus, 512)


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory, enc):
    """tiny, with the tokenizer, sharded by a 1 MB threshold."""
    root = tmp_path_factory.mktemp("tiny")
    state = random_state(TINY)
    save_checkpoint(root / "ck", state, TINY, step=5, tokenizer=enc)
    export_checkpoint(root / "ck", root / "hf", shard_size_bytes=10**6)
    return state, root / "hf"


def load_hf(path, **kw):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    assert not info["error_msgs"]
    assert type(model).__name__ == "GptOssForCausalLM" and type(model.config).__name__ == "GptOssConfig"
    return model


def hf_tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update((k, s.get_tensor(k)) for k in s.keys())
    return out


def assert_parity(cfg, state, hf_dir, seq):
    assert seq > cfg.sliding_window       # the window must actually cut off keys
    tokens = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    report = compare_with_transformers(cfg, state, tokens, hf_dir=hf_dir)
    assert report["rel_err"] <= 1e-5 and report["top1_agreement"] == 1.0, report
    return report


# ---- export: loads, matches ---------------------------------------------------------------
def test_tiny_export_loads_sharded_and_matches(tiny_export):
    state, hf = tiny_export
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert set(index["weight_map"]) == set(hf_mapping.hf_shapes(TINY))
    assert not (hf / "model.safetensors").exists()
    model = load_hf(hf)
    assert model.dtype == torch.float32
    c = model.config
    assert c.rope_parameters == {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}
    assert (c.sliding_window, c.layer_types, c.num_local_experts, c.num_experts_per_tok) == (
        64, list(TINY.layer_types), 8, 2)
    assert (c.bos_token_id, c.eos_token_id, c.swiglu_limit) == (511, 511, 7.0)
    gen = json.loads((hf / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 511 and gen["eos_token_id"] == 511
    assert "step 5" in (hf / "README.md").read_text()
    assert_parity(TINY, state, hf, seq=80)


@pytest.mark.parametrize("cfg, seq", [(ALT, 24), (DENSE, 16)], ids=["alt", "dense"])
def test_export_loads_and_matches(tmp_path, cfg, seq):
    state = random_state(cfg, seed=3)
    save_checkpoint(tmp_path / "ck", state, cfg)
    export_checkpoint(tmp_path / "ck", tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    model = load_hf(tmp_path / "hf")
    if not cfg.is_moe:          # dense -> one expert with a zero router, top-1
        assert (model.config.num_local_experts, model.config.num_experts_per_tok) == (1, 1)
        assert model.config.intermediate_size == cfg.dense_dim
        assert not model.model.layers[0].mlp.router.weight.any()
    assert_parity(cfg, state, tmp_path / "hf", seq)


def test_in_memory_parity_report():
    state = random_state(ALT, seed=4)
    report = compare_with_transformers(ALT, state, torch.arange(30) % ALT.vocab_size)
    assert report["rel_err"] <= 1e-5 and report["top1_agreement"] == 1.0
    assert report["shape"] == [1, 30] and report["max_abs_err"] >= 0


def test_bf16_export(tmp_path):
    state = random_state(ALT)
    save_checkpoint(tmp_path / "ck", state, ALT)
    export_checkpoint(tmp_path / "ck", tmp_path / "hf", dtype="bfloat16")
    written = hf_tensors(tmp_path / "hf")
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    assert torch.equal(written["lm_head.weight"], state["lm_head.weight"].bfloat16())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    model = load_hf(tmp_path / "hf", dtype="auto")
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_tokenizer_export_matches_tiktoken(tiny_export, enc):
    from formats.tokenizer import load_tokenizer
    _, hf = tiny_export
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    assert tok.bos_token == "<|bos|>" and tok.bos_token_id == 511
    for text in SAMPLES + [open(hf_mapping.__file__).read()]:
        ids = enc.encode(text, allowed_special="all")
        assert tok.encode(text, add_special_tokens=False) == ids
        assert tok.encode(text) == ids           # no BOS/EOS added behind the user's back
        assert tok.decode(ids) == text
    assert load_tokenizer(hf / "tiktoken").encode("hello world") == enc.encode("hello world")


# ---- import: round trips --------------------------------------------------------------------
def hf_source(path, cfg, dtype, shard="200KB"):
    """A GptOss directory written by transformers itself (sharded), with random weights."""
    hf_cfg = hf_mapping.build_hf_config(cfg, dtype=str(dtype).removeprefix("torch."))
    model = transformers.GptOssForCausalLM(hf_cfg)
    model.load_state_dict(hf_mapping.to_hf_state(random_state(cfg, seed=7), cfg))
    model.to(dtype).save_pretrained(path, max_shard_size=shard)
    return hf_tensors(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_import_export_round_trip_is_bit_exact(tmp_path, dtype):
    source = hf_source(tmp_path / "src", ALT, dtype)
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    import_hf(tmp_path / "src", tmp_path / "ck")
    state, cfg, meta = load_checkpoint(tmp_path / "ck")
    assert cfg == ALT and meta["imported_from"]["dtypes"] == [str(dtype).removeprefix("torch.")]
    export_checkpoint(tmp_path / "ck", tmp_path / "out", dtype=str(dtype).removeprefix("torch."))
    back = hf_tensors(tmp_path / "out")
    assert back.keys() == source.keys()
    for name, t in source.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].view(torch.int16 if dtype == torch.bfloat16
                                                                           else torch.int32),
                                                           t.view(torch.int16 if dtype == torch.bfloat16
                                                                  else torch.int32)), name
    src_cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    for field in ("rope_parameters", "layer_types", "sliding_window", "num_local_experts", "num_experts_per_tok",
                  "intermediate_size", "head_dim", "num_key_value_heads", "swiglu_limit", "dtype"):
        assert out_cfg[field] == src_cfg[field], field


def test_export_import_restores_our_config_and_tokenizer(tmp_path, tiny_export, enc):
    state, hf = tiny_export
    import_hf(hf, tmp_path / "ck")
    loaded, cfg, meta = load_checkpoint(tmp_path / "ck")
    assert cfg == TINY                    # incl. fields transformers has no place for (max_seq_len ...)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    from formats.checkpoint import tokenizer_dir
    from formats.tokenizer import load_tokenizer
    assert load_tokenizer(tokenizer_dir(tmp_path / "ck", meta)).encode(SAMPLES[1]) == enc.encode(SAMPLES[1])


def test_dense_round_trip(tmp_path):
    state = random_state(DENSE, seed=5)
    save_checkpoint(tmp_path / "ck", state, DENSE)
    export_checkpoint(tmp_path / "ck", tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "as_dense", dense=True)
    loaded, cfg, _ = load_checkpoint(tmp_path / "as_dense")
    assert cfg == DENSE and all(torch.equal(loaded[k], state[k]) for k in state)
    import_hf(tmp_path / "hf", tmp_path / "as_moe")          # default: a one-expert MoE
    moe_state, moe_cfg, _ = load_checkpoint(tmp_path / "as_moe")
    assert (moe_cfg.n_experts, moe_cfg.experts_per_token, moe_cfg.expert_dim) == (1, 1, DENSE.dense_dim)
    tokens = torch.randint(0, 512, (1, 12))
    assert torch.equal(_logits(moe_cfg, moe_state, tokens), _logits(DENSE, state, tokens))
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    with pytest.raises(UserError, match=r"num_local_experts.*expected 1"):
        hf_mapping.model_config_from_hf({**hf_cfg, "num_local_experts": 2}, dense=True)


def _logits(cfg, state, tokens):
    model = GptOssForCausalLM(cfg).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(tokens)


def test_dense_import_refuses_a_nonzero_router(tmp_path):
    save_checkpoint(tmp_path / "ck", random_state(DENSE), DENSE)
    export_checkpoint(tmp_path / "ck", tmp_path / "hf")
    tensors = hf_tensors(tmp_path / "hf")
    tensors["model.layers.1.mlp.router.bias"] = torch.ones(1)
    safetensors.torch.save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"model\.layers\.1\.mlp\.router\.bias is not all zeros"):
        import_hf(tmp_path / "hf", tmp_path / "out", dense=True)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


# The released openai/gpt-oss-20b config.json (transformers 4.55 era: legacy "rope_scaling").
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}


def test_released_gpt_oss_config_maps_to_the_preset():
    cfg = hf_mapping.model_config_from_hf(GPT_OSS_20B)
    assert cfg == hf_mapping.model_config_from_hf({k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"})
    with pytest.raises(UserError, match=r"field 'hidden_size' expected a multiple of 32 for MXFP4 expert weights, "
                                        r"found 2888"):
        hf_mapping.model_config_from_hf({**GPT_OSS_20B, "hidden_size": 2888})
    preset = get_preset("gpt-oss-20b")
    # config.json names no bos id; max_seq_len is a training setting, not in the file.
    assert cfg == preset.replace(bos_token_id=0, max_seq_len=cfg.max_seq_len)
    assert cfg.router_aux_loss_coef == 0.0      # training settings never come from a foreign file
    assert hf_mapping.hf_shapes(cfg)["model.layers.0.mlp.experts.gate_up_proj"] == (32, 2880, 5760)


# ---- errors name the problem and leave nothing behind --------------------------------------
def raw_checkpoint(path, tensors, model_dict):
    """A checkpoint written straight through the Orbax writer, bypassing save_checkpoint's checks."""
    import jax.numpy as jnp

    from formats.checkpoint import CheckpointWriter

    writer = CheckpointWriter(path, keep=1)
    writer.save(0, {"params": {k: jnp.asarray(v.numpy()) for k, v in tensors.items()}}, {"model": model_dict})
    writer.close()


@pytest.mark.parametrize("case, expected", [
    ("missing", r"tensor model\.layers\.1\.mlp\.experts\.down_proj is missing \(expected shape \[4, 32, 64\]\)"),
    ("extra", r"unexpected tensor model\.layers\.0\.mlp\.experts\.scale of shape \[4\]"),
    ("shape", r"tensor model\.layers\.0\.self_attn\.sinks has shape \[4\], expected \[8\]"),
    ("head_dim", r"head_dim must be even for RoPE, found 15"),
    ("experts_per_token", r"experts_per_token must be in 1\.\.n_experts \(4\), found 5"),
    ("layer_type", r"unknown layer type 'chunked'"),
    ("beta_fast", r"ModelConfig\.rope_beta_fast: expected > 0 for transformers' GptOss, found 0"),
    ("bos", r"ModelConfig\.bos_token_id: expected a token id in 0\.\.511, found 600"),
])
def test_export_rejects_bad_checkpoints(tmp_path, case, expected):
    tensors, model = random_state(SMALL), SMALL.to_dict()
    if case == "missing":
        del tensors["model.layers.1.mlp.experts.down_proj"]
    elif case == "extra":
        tensors["model.layers.0.mlp.experts.scale"] = torch.ones(4)
    elif case == "shape":
        tensors["model.layers.0.self_attn.sinks"] = torch.ones(4)
    elif case == "layer_type":
        model["layer_types"] = ["sliding_attention", "chunked"]
    elif case == "beta_fast":
        model["rope_beta_fast"] = 0
    elif case == "bos":
        model["bos_token_id"] = 600
    else:
        model[case] = {"head_dim": 15, "experts_per_token": 5}[case]
    raw_checkpoint(tmp_path / "ck", tensors, model)
    with pytest.raises(UserError, match=expected):
        export_checkpoint(tmp_path / "ck", tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and leftovers(tmp_path / "hf") == []


def test_export_refuses_a_non_empty_out_dir(tmp_path):
    save_checkpoint(tmp_path / "ck", random_state(SMALL), SMALL)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(UserError, match=r"hf: output directory exists and is not empty \(pass --overwrite"):
        export_checkpoint(tmp_path / "ck", out)
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"] and leftovers(out) == []
    export_checkpoint(tmp_path / "ck", out, overwrite=True)
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file() and leftovers(out) == []
    with pytest.raises(UserError, match="--dtype: expected one of float32, bfloat16, mxfp4, found 'float16'"):
        export_checkpoint(tmp_path / "ck", tmp_path / "other", dtype="float16")


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_hf")
    save_checkpoint(root / "ck", random_state(SMALL), SMALL)
    export_checkpoint(root / "ck", root / "hf")
    return root / "hf"


def broken_copy(src, dst, *, config=None, tensors=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    ts = hf_tensors(src)
    safetensors.torch.save_file(tensors(ts) if tensors else ts, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _quantized_tensors(ts):
    """As gpt-oss ships its experts: MXFP4 blocks and scales instead of the float tensor."""
    del ts["model.layers.0.mlp.experts.gate_up_proj"]
    ts["model.layers.0.mlp.experts.gate_up_proj_blocks"] = torch.zeros(4, 64, 2, 16, dtype=torch.uint8)
    ts["model.layers.0.mlp.experts.gate_up_proj_scales"] = torch.zeros(4, 64, 2, dtype=torch.uint8)
    return ts


@pytest.mark.parametrize("case, expected", [
    ("quantization_config", r"config\.json: field 'quantization_config\.quant_method' expected 'mxfp4' \(gpt-oss's "
                            r"release\), found 'bitsandbytes'"),
    ("mxfp4_tensors", r"model\.safetensors: tensor model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks is "
                      r"MXFP4-quantized but config\.json has no quantization_config"),
    ("missing", r"tensor lm_head\.weight is missing \(expected shape \[512, 64\]\)"),
    ("extra", r"unexpected tensor model\.rotary_emb\.inv_freq of shape \[8\]"),
    ("shape", r"tensor model\.layers\.1\.mlp\.router\.weight has shape \[3, 64\], expected \[4, 64\]"),
    ("truncate", r"field 'rope_parameters\.truncate' expected false"),
    ("rope_type", r"field 'rope_parameters\.rope_type' expected 'yarn' or 'default', found 'llama3'"),
    ("model_type", r"field 'model_type' expected 'gpt_oss', found 'llama'"),
    ("tied", r"field 'tie_word_embeddings' expected false"),
    ("head_dim", r"head_dim must be even for RoPE, found 15"),
])
def test_import_rejects_bad_hf_dirs(tmp_path, small_hf, case, expected):
    config = {
        "quantization_config": lambda c: {**c, "quantization_config": {"quant_method": "bitsandbytes"}},
        "truncate": lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "truncate": True}},
        "rope_type": lambda c: {**c, "rope_parameters": {**c["rope_parameters"], "rope_type": "llama3"}},
        "model_type": lambda c: {**c, "model_type": "llama"},
        "tied": lambda c: {**c, "tie_word_embeddings": True},
        "head_dim": lambda c: {**c, "head_dim": 15},
    }.get(case)
    tensors = {
        "mxfp4_tensors": _quantized_tensors,
        "missing": lambda ts: {k: v for k, v in ts.items() if k != "lm_head.weight"},
        "extra": lambda ts: {**ts, "model.rotary_emb.inv_freq": torch.ones(8)},
        "shape": lambda ts: {**ts, "model.layers.1.mlp.router.weight": torch.ones(3, 64)},
    }.get(case)
    src = broken_copy(small_hf, tmp_path / "src", config=config, tensors=tensors)
    with pytest.raises(UserError, match=expected):
        import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path / "out") == []


def test_import_errors_for_files_and_out_dir(tmp_path, small_hf):
    with pytest.raises(UserError, match="model directory not found"):
        import_hf(tmp_path / "nope", tmp_path / "out")
    src = broken_copy(small_hf, tmp_path / "src")
    (src / "model.safetensors").rename(src / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"found neither \(found pytorch_model\.bin: only safetensors"):
        import_hf(src, tmp_path / "out")
    out = tmp_path / "out"
    out.mkdir()
    (out / "x").write_text("keep")
    with pytest.raises(UserError, match="not empty"):
        import_hf(small_hf, out)
    assert [p.name for p in out.iterdir()] == ["x"]
    import_hf(small_hf, out, overwrite=True)
    assert load_checkpoint(out)[1] == SMALL


def test_cli_functions(tmp_path, small_hf, capsys):
    parser = argparse.ArgumentParser()
    hf_import.add_arguments(parser)
    args = parser.parse_args(["--hf", str(small_hf), "--out", str(tmp_path / "ck")])
    assert hf_import.run(args) == 0
    parser = argparse.ArgumentParser()
    hf_export.add_arguments(parser)
    args = parser.parse_args(["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"),
                              "--dtype", "bfloat16", "--shard-size", "100KB"])
    assert hf_export.run(args) == 0
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    out = capsys.readouterr().out
    assert "imported" in out and "exported step 0" in out
    assert hf_export.parse_size("2GB") == 2 * 10**9 and hf_export.parse_size("1234") == 1234
    with pytest.raises(UserError, match="--shard-size"):
        hf_export.parse_size("lots")
