"""gpt-oss's released MXFP4 layout: the codec against transformers' reference, reading a
released-layout directory (written here by hand, odd shapes, several shards), import against
transformers' own load, MXFP4 export and its round trip, and bad input named in one line."""
import json

import numpy as np
import pytest
import safetensors.torch
import torch

from formats import mxfp4
from formats.hf_export import export_checkpoint
from formats.hf_import import import_hf
from parity.hf_parity import compare_with_transformers
from formats.hf_weights import HFWeights
from torch_model.config import get_preset
from formats.checkpoint import load_checkpoint
from formats.errors import UserError

transformers = pytest.importorskip("transformers")
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

# Odd on purpose: 3 experts (no even expert split), gate_up rows 2*96 = 192 and down rows 64 (not
# multiples of 128), down_proj's input 96 = 3 blocks, hidden 64 = 2 blocks.
RELEASED = get_preset("tiny").replace(vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                                      n_experts=3, experts_per_token=2, expert_dim=96, sliding_window=5,
                                      bos_token_id=0, eos_token_id=1)
EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def random_packed(gen, shape, low=118, high=124):
    """Random MXFP4 bytes: every nibble equally likely, scales 2**-9 .. 2**-4."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(low, high, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


def write_released(path, cfg=RELEASED, *, seed=0, shards=3):
    """A directory laid out as gpt-oss is published: MXFP4 expert blocks/scales, everything else
    bf16, several shards with an index, quantization_config in config.json."""
    from formats import hf_mapping

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in hf_mapping.hf_shapes(cfg).items():
        if name.rpartition(".")[2] in EXPERT_WEIGHTS:
            experts, inputs, outputs = shape
            blocks, scales = random_packed(gen, (experts, outputs, inputs // 32))
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            base = 1.0 if name.endswith("norm.weight") else 0.0
            tensors[name] = (base + 0.05 * torch.randn(shape, generator=gen)).bfloat16()
    path.mkdir(parents=True)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        safetensors.torch.save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = hf_mapping.build_hf_config(cfg, dtype="bfloat16").to_dict()
    config.pop("torchlyra")
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    root = tmp_path_factory.mktemp("released")
    return root / "hf", write_released(root / "hf")


# ---- the codec ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1, 1), (2, 33, 3)])
def test_dequantize_is_bit_identical_to_transformers(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    blocks, scales = random_packed(gen, shape, low=0, high=253)     # every scale no code overflows
    scales[0, 0, 0], scales[-1, -1, -1] = 0, 252                    # subnormal and largest results
    ours = mxfp4.dequantize(blocks.numpy(), scales.numpy())
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)      # [E, G*32, rows]
        mine = torch.from_numpy(ours.transpose(0, 2, 1).copy()).to(dtype)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(mine.view(bits), theirs.view(bits)), dtype


def test_quantize_reproduces_every_dequantized_value():
    gen = torch.Generator().manual_seed(1)
    blocks, scales = random_packed(gen, (4, 9, 3), low=0, high=253)
    values = mxfp4.dequantize(blocks.numpy(), scales.numpy())
    again = mxfp4.dequantize(*mxfp4.quantize(values))
    assert np.array_equal(again, values)     # values, not bytes: an equivalent block may pick another scale


def test_quantize_rounds_to_nearest_even_and_saturates():
    block = np.zeros(32, np.float32)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25, 6.0]
    block[:len(ties)] = ties
    got = mxfp4.dequantize(*mxfp4.quantize(block[None]))[0]
    assert got[:len(ties)].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 0.0, 6.0]
    block[0] = 7.0                       # amax 7: scale 2**0 (floor(log2 7) - 2), 7 saturates to 6
    blocks, scales = mxfp4.quantize(block[None])
    assert scales.tolist() == [[127]] and mxfp4.dequantize(blocks, scales)[0, 0] == 6.0


def test_quantize_picks_the_nearest_grid_value_on_random_data():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 96)) * np.exp(rng.uniform(-8, 4, (6, 1)))).astype(np.float32)
    blocks, scales = mxfp4.quantize(x)
    got = mxfp4.dequantize(blocks, scales).reshape(6, 3, 32)
    scale = np.ldexp(1.0, scales.astype(np.int32) - 127)[..., None, None]
    grid = mxfp4.FP4_VALUES[None, None, None, :] * scale                         # [6, 3, 1, 16]
    xb = x.reshape(6, 3, 32)
    best = np.abs(xb[..., None] - grid).min(-1)
    assert np.allclose(np.abs(xb - got), best, rtol=0, atol=0)
    amax = np.abs(xb).max(-1)
    assert np.all(np.abs(got).max(-1) <= 6 * scale[..., 0, 0]) and np.all(6 * scale[..., 0, 0] * 2 > amax)


def test_codec_refuses_overflowing_scales_and_partial_blocks():
    blocks = np.zeros((1, 2, 16), np.uint8)
    for byte in (254, 255):
        with pytest.raises(UserError, match=f"w: scale byte {byte} overflows float32"):
            mxfp4.dequantize(blocks, np.array([[3, byte]], np.uint8), "w")
    blocks[0, 1, 5] = 0x70                                  # code 7 (6.0) at 2**126: beyond float32
    with pytest.raises(UserError, match=r"w: scale byte 253 overflows float32 for block \[0, 1\]"):
        mxfp4.dequantize(blocks, np.array([[3, 253]], np.uint8), "w")
    with pytest.raises(UserError, match=r"w: MXFP4 blocks of shape \[1, 2, 16\] need scales of shape \[1, 2\]"):
        mxfp4.dequantize(blocks, np.zeros((1, 3), np.uint8), "w")
    with pytest.raises(UserError, match=r"w: MXFP4 needs the last dimension to be a multiple of 32, found shape \[2, 48\]"):
        mxfp4.quantize(np.zeros((2, 48)), "w")


# ---- reading the released layout ----------------------------------------------------------------------
def test_slices_cross_block_boundaries(released):
    hf, tensors = released
    weights = HFWeights(hf, quantized=True)
    name = "model.layers.1.mlp.experts.down_proj"          # [3 experts, 96 in, 64 out]
    whole = weights.read(name)
    theirs = convert_moe_packed_tensors(tensors[name + "_blocks"], tensors[name + "_scales"], dtype=torch.float32)
    assert whole.shape == (3, 96, 64) and np.array_equal(whole, theirs.numpy())
    for index in [(slice(1, 3), slice(20, 75), slice(5, 64)), (slice(0, 1), slice(31, 33), slice(0, 1))]:
        before = weights.bytes_requested
        assert np.array_equal(weights.read(name, index), whole[index])
        assert weights.bytes_requested - before < whole.size    # only the covering blocks were read


@pytest.fixture(scope="module")
def imported(tmp_path_factory, released):
    ck = tmp_path_factory.mktemp("imported") / "ck"
    summary = import_hf(released[0], ck)
    assert summary["dtypes"] == ["bfloat16", "mxfp4"]
    return ck


def test_released_import_matches_transformers_own_load(released, imported):
    hf, _ = released
    state, cfg, meta = load_checkpoint(imported)
    assert cfg == RELEASED.replace(max_seq_len=cfg.max_seq_len, router_aux_loss_coef=0.0)   # a foreign file sets no training settings
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    report = compare_with_transformers(cfg, state, tokens, hf_dir=hf)   # transformers dequantizes itself
    assert report["rel_err"] <= 1e-5 and report["top1_agreement"] == 1.0, report


# ---- bad input: one line naming file and tensor, nothing left behind ---------------------------------
def leftovers(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def break_released(hf, case):
    index = hf / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    name = "model.layers.0.mlp.experts.gate_up_proj"
    file = hf / weight_map[name + "_blocks"]
    if case == "truncated":
        data = file.read_bytes()
        file.write_bytes(data[:len(data) - 100])
        return rf"{file.name}: unreadable safetensors file"
    if case == "missing_file":
        weight_map["lm_head.weight"] = "model-00009-of-00009.safetensors"
        index.write_text(json.dumps({"weight_map": weight_map}))
        return (r"model\.safetensors\.index\.json: names shard model-00009-of-00009\.safetensors \(for tensor "
                r"lm_head\.weight\), which is missing")
    if case == "scales_shape":
        tensors = safetensors.torch.load_file(str(hf / weight_map[name + "_scales"]))
        tensors[name + "_scales"] = tensors[name + "_scales"][:, :, :1].contiguous()
        safetensors.torch.save_file(tensors, str(hf / weight_map[name + "_scales"]), metadata={"format": "pt"})
        return (rf"tensor {name}_blocks \(scales {name}_scales\): MXFP4 blocks of shape \[3, 192, 2, 16\] need "
                rf"scales of shape \[3, 192, 2\] \(blocks \[\.\.\., G, 16\]\), found \[3, 192, 1\]")
    if case == "scale_byte":
        tensors = safetensors.torch.load_file(str(hf / weight_map[name + "_scales"]))
        tensors[name + "_scales"][2, 7, 1] = 255
        safetensors.torch.save_file(tensors, str(hf / weight_map[name + "_scales"]), metadata={"format": "pt"})
        return rf"{weight_map[name + '_blocks']}: tensor {name}_blocks: scale byte 255 overflows float32"
    config = json.loads((hf / "config.json").read_text())
    if case == "quant_method":
        config["quantization_config"]["quant_method"] = "fp8"
        expected = r"config\.json: field 'quantization_config\.quant_method' expected 'mxfp4' .*found 'fp8'"
    else:                                   # architecture: attention without bias
        config["attention_bias"] = False
        expected = r"config\.json: field 'attention_bias' expected true"
    (hf / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("case", ["truncated", "missing_file", "scales_shape", "scale_byte", "quant_method",
                                  "architecture"])
def test_bad_released_dirs_are_named_in_one_line(tmp_path, released, case):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(released[0], hf)
    expected = break_released(hf, case)
    with pytest.raises(UserError, match=expected) as raised:
        import_hf(hf, tmp_path / "ck")
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "ck").exists() and leftovers(tmp_path / "ck") == []


# ---- the tokenizer ---------------------------------------------------------------------------------------
def harmony_tokenizer_json(enc):
    """tokenizer.json as gpt-oss ships it, reduced to what recognition reads: the byte-level
    BPE vocabulary and the added (special) tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_char = bytes_to_unicode()
    vocab = {"".join(to_char[b] for b in token): rank for token, rank in enc._mergeable_ranks.items()}
    added = [{"id": i, "content": name, "special": True} for name, i in enc._special_tokens.items()]
    return {"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": added}


def test_o200k_harmony_is_recognised_and_a_different_one_named(tmp_path):
    from formats.hf_tokenizer import recognize, vocabulary_difference
    from formats.tokenizer import o200k_harmony

    enc = o200k_harmony()
    found = harmony_tokenizer_json(enc)
    (tmp_path / "tokenizer.json").write_text(json.dumps(found))
    got, line = recognize(tmp_path)
    assert got is enc and line.startswith("o200k_harmony")
    found["added_tokens"] = [a for a in found["added_tokens"] if a["content"] != "<|return|>"]
    assert vocabulary_difference(found, enc) == "special token '<|return|>' is missing"
    token, rank = next(iter(found["model"]["vocab"].items()))     # the first one compared
    found["model"]["vocab"][token] = rank + 1
    assert vocabulary_difference(found, enc) == f"token {token!r} has id {rank + 1}, expected {rank}"
    (tmp_path / "tokenizer.json").write_text("{}")
    got, line = recognize(tmp_path)
    assert got is None and "is not o200k_harmony (model type None, expected a byte-level 'BPE') and does not " \
        "convert" in line and line.endswith("no tokenizer attached")


# ---- export to the released layout ----------------------------------------------------------------
def read_dir(path):
    from safetensors import safe_open
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update((k, s.get_tensor(k)) for k in s.keys())
    return out


def dequantized(tensors):
    """Every tensor by its transformers name, expert weights dequantized by transformers' reference."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            out[base] = convert_moe_packed_tensors(t, tensors[base + "_scales"], dtype=torch.float32)
        elif not name.endswith("_scales"):
            out[name] = t
    return out


def test_released_import_export_round_trip_and_transformers_loads_it(tmp_path, released, imported):
    hf, source = released
    summary = export_checkpoint(imported, tmp_path / "out", dtype="mxfp4", shard_size_bytes=20_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(summary["files"]) > 3 and set(index["weight_map"]) == set(source)
    back = read_dir(tmp_path / "out")
    assert all(back[n].dtype == t.dtype and back[n].shape == t.shape for n, t in source.items())
    want, got = dequantized(source), dequantized(back)
    for name, t in want.items():        # values, not bytes: an equivalent block may pick another scale
        assert torch.equal(got[name].float(), t.float()), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((hf / "config.json").read_text())["quantization_config"]
    state, cfg, _ = load_checkpoint(imported)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    report = compare_with_transformers(cfg, state, tokens, hf_dir=tmp_path / "out")
    assert report["rel_err"] <= 1e-5 and report["top1_agreement"] == 1.0, report


def test_float32_export_reports_its_quantization_error(tmp_path):
    from tests.test_hf_export import random_state
    from formats.checkpoint import save_checkpoint

    state = random_state(RELEASED, seed=5)
    save_checkpoint(tmp_path / "ck", state, RELEASED)
    summary = export_checkpoint(tmp_path / "ck", tmp_path / "out", dtype="mxfp4")
    written = json.loads((tmp_path / "out" / "mxfp4_error.json").read_text())["relative_error"]
    back = dequantized(read_dir(tmp_path / "out"))
    quantized_state = dict(state)
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            error = float((back[name] - t).norm() / t.norm())
            assert written[name] == pytest.approx(error, rel=1e-6) and 0 < error < 0.5, name
            quantized_state[name] = back[name]
        else:
            assert torch.equal(back[name], t.bfloat16()), name
    assert set(written) == {n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert summary["quantization_error"] == written
    # The quantized model against the unquantized one on a fixed batch (reported, see the README).
    from torch_model.model import GptOssForCausalLM
    tokens = torch.randint(0, RELEASED.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    logits = []
    for s in (state, quantized_state):
        model = GptOssForCausalLM(RELEASED).eval()
        model.load_state_dict({k: v.float() for k, v in s.items()})
        with torch.no_grad():
            logits.append(model(tokens).double().log_softmax(-1))
    kl = float((logits[0].exp() * (logits[0] - logits[1])).sum(-1).mean())
    top1 = float((logits[0].argmax(-1) == logits[1].argmax(-1)).double().mean())
    print(f"MXFP4 export of a float32 checkpoint: relative error per tensor {min(written.values()):.4f}.."
          f"{max(written.values()):.4f}; KL(unquantized || quantized) {kl:.3e} nats/token, top-1 {top1:.3f}")
    assert 0 < kl < 0.1


def test_exported_harmony_chat_template_renders_as_harmony(tmp_path):
    """A tokenizer with the harmony markers gets the chat template; transformers renders a
    conversation with it exactly as the harmony format (train/generation/chat.py) lays it out."""
    import tiktoken

    from formats.hf_export import write_tokenizer
    from formats.tokenizer import train_bpe

    small = train_bpe(["<|start|>user<|message|>Hello there, how are you?<|end|>"] * 10, 300)
    names = ["<|bos|>", "<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|return|>"]
    first = small.n_vocab
    enc = tiktoken.Encoding(name="mini-harmony", pat_str=small._pat_str, mergeable_ranks=small._mergeable_ranks,
                            special_tokens={n: first + i for i, n in enumerate(names)})
    cfg = RELEASED.replace(bos_token_id=first, eos_token_id=first + 5)
    assert "harmony chat_template.jinja" in write_tokenizer(enc, tmp_path, cfg)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "Hi.", "channel": "final"}, {"role": "user", "content": "how are you?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = ("<|start|>system<|message|>Be brief.<|end|><|start|>user<|message|>Hello there<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Hi.<|end|><|start|>user<|message|>how are you?<|end|>"
            "<|start|>assistant")
    assert list(ids) == enc.encode(text, allowed_special="all")


def test_device_decoding_is_bit_exact_against_the_host_codec_at_every_scale_byte():
    """pallas_kernels.mxfp4 builds bfloat16 bits from integers: every E2M1 code at every scale byte
    the host codec accepts (0-253; 0-1 give subnormals, which float arithmetic in XLA flushes)
    gives the host's float32 value rounded to bfloat16, bit for bit, signed zeros included."""
    import jax
    import ml_dtypes

    from formats import mxfp4 as host
    from pallas_kernels.mxfp4 import dequantize_mxfp4

    scales = np.arange(host.MAX_SCALE_BYTE + 1, dtype=np.uint8)[:, None]     # a row of one block per scale byte
    codes = np.arange(32) % 16                                             # every code, twice
    blocks = np.broadcast_to((codes[0::2] | (codes[1::2] << 4)).astype(np.uint8), (len(scales), 1, 16)).copy()
    blocks[-1] = 0x31                     # byte 253 overflows for magnitudes 4 and 6: the host refuses those
    want = host.dequantize(blocks, scales).astype(ml_dtypes.bfloat16).view(np.uint16)
    got = np.asarray(jax.jit(dequantize_mxfp4)(blocks, scales)).view(np.uint16)
    assert got.shape == want.shape == (len(scales), 32)
    assert np.array_equal(got, want), np.argwhere(got != want)[:5]
    subnormal = np.concatenate([got[0, 1:4], got[1, 1:2]])   # 0.5, 1, 1.5 x 2**-127 and 0.5 x 2**-126
    assert ((subnormal & 0x7F80) == 0).all() and (subnormal != 0).all()      # subnormal, not flushed
    # Random blocks over a batch of stacks and groups, as gpt-oss stores them ([E, rows, G, 16]).
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (3, 5, 4), dtype=np.uint8)
    want = host.dequantize(blocks, scales).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.array_equal(np.asarray(dequantize_mxfp4(blocks, scales)).view(np.uint16), want)
