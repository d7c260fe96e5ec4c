"""`generate`, `eval` and `parity --checkpoint` read a released-layout (MXFP4) Hugging Face
directory directly, through the one checkpoint loader, with the same results as its imported
checkpoint; and generation never chooses an id its tokenizer cannot decode. The model's
vocabulary (512) exceeds its tokenizer's (320) and its head prefers the ids beyond: before the
fix the samples at the end of a run and `generate` crashed with `KeyError: Invalid token`."""
import json

import numpy as np
import pytest
import safetensors.torch
import torch

from formats.hf_import import import_hf
from tests.helpers import prepare_play_corpus
from tests.test_mxfp4 import RELEASED, write_released
from formats.checkpoint import checkpoint_tokenizer, load_checkpoint
from train.cli import main
from formats.tokenizer import decodable_ids, load_tokenizer, o200k_base, save_tokenizer
from formats.errors import UserError
from train.generation.generator import Generator, load_for_generation, load_model
from train.generation.sampling import SamplingConfig

TOKENIZER_VOCAB, NEW = 320, 10
LINES = ["ROMEO", "JULIET: O"]


def prefer_ids_beyond(hf_dir, first: int) -> None:
    """Rewrite lm_head so that an id >= `first` outscores the others whatever the hidden state:
    half of them point along +e0, half along -e0, with a large norm."""
    weight_map = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shard = hf_dir / weight_map["lm_head.weight"]
    tensors = safetensors.torch.load_file(str(shard))
    head = tensors["lm_head.weight"].float()
    middle = (first + head.shape[0]) // 2
    head[first:] = 0
    head[first:middle, 0], head[middle:, 0] = 100.0, -100.0
    tensors["lm_head.weight"] = head.bfloat16()
    safetensors.torch.save_file(tensors, str(shard), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(released dir carrying the data's 320-id tokenizer as our exports do, its imported
    checkpoint, prepared data)."""
    root = tmp_path_factory.mktemp("released_commands")
    data = prepare_play_corpus(root)
    write_released(root / "hf", RELEASED, seed=3)
    prefer_ids_beyond(root / "hf", TOKENIZER_VOCAB)
    save_tokenizer(load_tokenizer(data), root / "hf" / "tiktoken")
    import_hf(root / "hf", root / "ck")
    return root / "hf", root / "ck", data


def test_the_loader_reads_a_released_directory_as_its_imported_checkpoint(dirs):
    hf, ck, data = dirs
    state, cfg, meta = load_checkpoint(hf)
    imported, imported_cfg, _ = load_checkpoint(ck)
    assert cfg == imported_cfg and state.keys() == imported.keys()
    assert all(torch.equal(state[k], imported[k]) for k in state)        # MXFP4 and bf16 are exact in float32
    assert meta["step"] == 0 and meta["imported_from"]["dtypes"] == ["bfloat16", "mxfp4"]
    enc, line = checkpoint_tokenizer(hf, meta)
    assert enc is not None and enc.encode("ROMEO") == load_tokenizer(data).encode("ROMEO"), line


def test_generate_names_a_released_directory_without_a_tokenizer(tmp_path):
    write_released(tmp_path / "bare", RELEASED, seed=4)
    with pytest.raises(UserError, match=r"bare: no tokenizer to generate text with \(tokenizer: none \(no tokenizer.json\)\)"):
        load_for_generation(tmp_path / "bare")


def test_generate_from_a_released_directory_equals_its_imported_checkpoint(dirs, capsys):
    hf, ck, data = dirs
    enc = load_tokenizer(data)
    prompts = [[RELEASED.bos_token_id] + enc.encode_ordinary(line) for line in LINES]
    model = load_model(ck)
    with torch.no_grad():                                     # unrestricted, greedy would pick ids >= 320
        first = [int(model(torch.tensor([p]))[0, -1].argmax()) for p in prompts]
    assert all(t >= TOKENIZER_VOCAB for t in first), first
    model, tokenizer = load_for_generation(ck)
    generator = Generator(model, tokenizer=tokenizer)         # restricted to the checkpoint's tokenizer
    sampling = SamplingConfig(max_new_tokens=NEW, temperature=0, stop_tokens=(RELEASED.eos_token_id,))
    tokens = generator.generate(prompts, sampling).tokens
    assert all(0 <= t < TOKENIZER_VOCAB for row in tokens for t in row) and len(tokens[0]) > 1, tokens
    hidden = {RELEASED.bos_token_id, RELEASED.eos_token_id}
    expected = "".join(f"--- prompt: {line!r}\n{line + enc.decode([t for t in row if t not in hidden])}\n\n"
                       for line, row in zip(LINES, tokens))
    args = [a for line in LINES for a in ("--prompt", line)]
    assert main(["generate", "--checkpoint", str(hf), *args, "--temperature", "0", "--max-tokens", str(NEW),
                 "--no-stream"]) == 0
    assert capsys.readouterr().out == expected


def test_end_of_run_samples_never_choose_ids_beyond_the_tokenizer(dirs):
    from train.run.config import TrainConfig
    from train.run.trainer import sample_texts

    _, ck, data = dirs
    # Greedy (the programs of the test above); the sampler's masking in every mode is tested in
    # tests/test_kernel_decode.py.
    samples = sample_texts(Generator(load_model(ck), tokenizer=load_tokenizer(data)), load_tokenizer(data),
                           TrainConfig(samples=2, sample_tokens=NEW, temperature=0))
    assert len(samples) == 2 and all(s["text"].startswith(s["prompt"]) for s in samples)


def test_eval_of_a_released_directory_equals_its_imported_checkpoint(dirs):
    from train.evaluation.validation import evaluate_checkpoint

    hf, ck, data = dirs
    from_hf = evaluate_checkpoint(str(hf), data=data, batches=1)
    from_ck = evaluate_checkpoint(str(ck), data=data, batches=1)
    assert from_hf["val_loss"] == from_ck["val_loss"] and np.isfinite(from_hf["val_loss"])
    assert from_hf["val_bpb"] == from_ck["val_bpb"] and from_hf["checkpoint"] == str(hf.resolve())


def test_parity_takes_a_released_directory(dirs, monkeypatch):
    """The command hands the suite the directory's weights (the suite itself is tested elsewhere)."""
    import parity.run

    hf, ck, _ = dirs
    handed = {}

    def record(model_cfg, state_dict, **kwargs):
        handed.update(cfg=model_cfg, state=state_dict)
        raise SystemExit(0)

    monkeypatch.setattr(parity.run, "run_parity", record)
    with pytest.raises(SystemExit):
        main(["parity", "--checkpoint", str(hf), "--kernels", "attention=xla", "--dtype", "float32"])
    imported, cfg, _ = load_checkpoint(ck)
    assert handed["cfg"].n_experts == cfg.n_experts and handed["cfg"].vocab_size == cfg.vocab_size
    assert all(torch.equal(handed["state"][k], imported[k]) for k in imported)


def test_decodable_ids_skip_unassigned_ids_and_refuse_a_larger_tokenizer():
    allowed = decodable_ids(o200k_base(), 201088)
    assert allowed[:200000].all() and not allowed[200000:200018].any() and allowed[200018]
    assert not allowed[200019:].any()
    with pytest.raises(UserError, match=r"tokenizer o200k_base has 200019 ids, more than the model's vocab_size \(512\)"):
        decodable_ids(o200k_base(), 512)
