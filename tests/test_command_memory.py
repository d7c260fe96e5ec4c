"""The bound on what a process holds, measured as scripts/command_memory.py measures it: a
two-process run (one CPU device per process) on a released-layout directory of ~1 GiB (hidden
2880, 4 experts, a 32k vocabulary, 2 layers: 1.64 GiB in float32) peaks at most half the
parameters' bytes in the compute dtype + 0.5 GiB of anonymous memory (RssAnon, sampled every
10 ms) above its interpreter's baseline, from loading to the end.

- `generate --mesh fsdp=2` folds fsdp into tensor (jax_bridge/sharding.py: inference_mesh);
  under fsdp each token gathered a layer and the LM head on every device (1.95-1.99 GiB).
- `train --init-from --lora --mesh fsdp=2`: with a batch this small the step leaves the expert
  stacks and the head where they lie and gathers the rows (sharding.fsdp_gathers_rows), and the
  compiler's freed heap goes back to the system (jax_bridge/host_memory.py); it gathered a layer's
  stacks and the head (2.49-2.54 GiB), then held the compiler's heap (1.41-1.43 GiB)."""
import sys
from pathlib import Path

import pytest

from tests.worker_env import worker_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import command_memory  # noqa: E402  (the sampler and the synthetic directory)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(the work directory: hf/ with the data's tokenizer, data/; the baseline; the bound)."""
    from formats.tokenizer import load_tokenizer, save_tokenizer
    from helpers import prepare_play_corpus

    work = tmp_path_factory.mktemp("memory")
    hf = work / "hf"
    command_memory.write_released(hf, 2, {"n_experts": 4, "vocab_size": 32768, "bos_token_id": 0, "eos_token_id": 1})
    prepare_play_corpus(work)
    save_tokenizer(load_tokenizer(work / "data"), hf / "tiktoken")
    params = command_memory.param_bytes(hf)
    assert 1.6 * 2**30 < params < 1.7 * 2**30
    return work, command_memory.baseline(worker_env()), params / 2 + 0.5 * 2**30


def run_within_the_bound(released, name: str, argv: list[str]) -> list[str]:
    """Run argv on two processes in its own log directory; require exit 0 and every process's
    peak within the bound; return the logs."""
    work, base, bound = released
    logs_dir = work / name
    logs_dir.mkdir()
    peaks = command_memory.run(command_memory.cluster(argv, 2), worker_env(), logs_dir)
    logs = [(logs_dir / f"process{i}.log").read_text() for i in range(2)]
    assert [code for *_, code in peaks] == [0, 0], logs
    for i, (loading, peak, _) in enumerate(peaks):
        print(f"{name}: process {i} {(peak - base) / 2**30:.2f} GiB above the baseline (bound {bound / 2**30:.2f})")
        assert 0 < loading <= peak, (i, loading, peak)
        assert peak - base <= bound, f"process {i}: {(peak - base) / 2**30:.2f} GiB over {bound / 2**30:.2f} GiB"
    return logs


def test_two_process_generate_holds_half_the_model_and_half_a_gib(released):
    hf = released[0] / "hf"
    logs = run_within_the_bound(released, "generate", [
        "generate", "--checkpoint", str(hf), "--prompt", "ROMEO:", "--max-tokens", "8", "--temperature", "0",
        "--no-stream", "--mesh", "fsdp=2"])
    assert "generate: mesh fsdp=2 runs as tensor=2" in logs[0] and "--- prompt: 'ROMEO:'" in logs[0]


def test_two_process_lora_training_on_fsdp_holds_half_the_model_and_half_a_gib(released):
    work = released[0]
    logs = run_within_the_bound(released, "train", [
        "train", "--init-from", str(work / "hf"), "--lora", "r=4,alpha=8,targets=attention", "--data",
        str(work / "data"), "--out", str(work / "lora"), "--steps", "1", "--batch-size", "4", "--seq-len", "16",
        "--samples", "0", "--eval-batches", "1", "--mesh", "fsdp=2"])
    assert "mesh: fsdp=2" in logs[0] and "trained to step 1" in logs[0], logs[0][-2000:]
    assert (work / "lora" / "checkpoints" / "1").is_dir()
