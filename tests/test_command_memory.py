"""Issue 34's bound on what a process holds, measured as scripts/command_memory.py measures it: a
two-process `generate --mesh fsdp=2` (one CPU device per process) of a released-layout directory
of ~1 GiB (hidden 2880, 4 experts, a 32k vocabulary, 2 layers: 1.64 GiB in float32) peaks at most
half the parameters' bytes in the compute dtype + 0.5 GiB of anonymous memory (RssAnon, sampled
every 10 ms) above its interpreter's baseline, from loading to the last token. Generation folds
fsdp into tensor (jax_bridge/sharding.py: inference_mesh); under fsdp each token gathered a layer
and the LM head on every device (1.95-1.99 GiB). `train --init-from --lora` on fsdp=2 is not held
to the bound: its step gathers a layer and the head (2.49-2.54 GiB; BENCHMARKS.md)."""
import sys
from pathlib import Path

from tests.worker_env import worker_env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import command_memory  # noqa: E402  (the sampler and the synthetic directory)


def test_two_process_generate_holds_half_the_model_and_half_a_gib(tmp_path):
    from formats.tokenizer import save_tokenizer, train_bpe

    hf = tmp_path / "hf"
    command_memory.write_released(hf, 2, {"n_experts": 4, "vocab_size": 32768, "bos_token_id": 0, "eos_token_id": 1})
    save_tokenizer(train_bpe([Path(__file__).read_text()] * 4, 300), hf / "tiktoken")
    env = worker_env()
    base, params = command_memory.baseline(env), command_memory.param_bytes(hf)
    assert 1.6 * 2**30 < params < 1.7 * 2**30
    bound = params / 2 + 0.5 * 2**30
    argv = ["generate", "--checkpoint", str(hf), "--prompt", "ROMEO:", "--max-tokens", "8", "--temperature", "0",
            "--no-stream", "--mesh", "fsdp=2"]
    peaks = command_memory.run(command_memory.cluster(argv, 2), env, tmp_path)
    logs = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
    assert [code for *_, code in peaks] == [0, 0], logs
    assert "generate: mesh fsdp=2 runs as tensor=2" in logs[0] and "--- prompt: 'ROMEO:'" in logs[0]
    for i, (loading, peak, _) in enumerate(peaks):
        assert 0 < loading <= peak, (i, loading, peak)
        assert peak - base <= bound, f"process {i}: {(peak - base) / 2**30:.2f} GiB over {bound / 2**30:.2f} GiB"
