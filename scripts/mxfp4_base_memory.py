"""Peak anonymous host memory (RssAnon) of building a frozen base whole on the host from a
released-layout directory, two ways (what `--merge` and the eager scorer hold; `train --lora`,
`generate`, `eval` and `lm-eval` place it slice by slice instead: scripts/command_memory.py):

  compute  (the default) the checkpoint loader's float32 state dict, MXFP4 decoded on the host,
           loaded into a float32 model (formats/checkpoint.py: load_checkpoint, then load_weights)
  mxfp4    (--base-dtype mxfp4) the model built on the meta device, the experts' stored bytes
           copied as they are, the rest in float32 (formats/mxfp4_experts.py: released_base)

    python scripts/mxfp4_base_memory.py WORKDIR [N_LAYERS] [VOCAB]     (defaults: 1 layer, vocab 32768)

The directory has gpt-oss-20b's expert and attention shapes (scripts/import_memory.py writes it;
a smaller vocabulary keeps the embedding from dominating a 24 GiB host). Each way runs in its own
child process, which samples its /proc/self/status every 10 ms; the baseline is RssAnon after
every import and before the first tensor is read.
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from import_memory import SAMPLER, WRITE  # noqa: E402  (the synthetic directory; the RssAnon sampler)

MEASURE = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[3])
import torch, jax  # noqa: F401
from formats.checkpoint import load_checkpoint
from formats.hf_model import open_hf
from formats.model_checks import build_model, load_weights
from formats.mxfp4_experts import released_base
""" + SAMPLER + r"""
start = time.perf_counter()
if sys.argv[2] == "mxfp4":
    model = released_base(*open_hf(sys.argv[1]))
else:
    state, cfg, _ = load_checkpoint(sys.argv[1])
    model = build_model(cfg)
    load_weights(model, state)
    del state
seconds = time.perf_counter() - start
held = sum(p.numel() * p.element_size() for p in model.parameters())
running[0] = False
thread.join()
print("RESULT " + json.dumps({"baseline_bytes": baseline, "peak_bytes": peak[0], "above_baseline_bytes": peak[0] - baseline,
                              "model_bytes": held, "seconds": seconds}))
"""

# scripts/import_memory.py's writer, with the vocabulary as a third setting.
WRITE_WITH_VOCAB = WRITE.replace('.replace(n_layers=layers,', '.replace(vocab_size=int(sys.argv[4]), bos_token_id=0, eos_token_id=1, n_layers=layers,')


def main(workdir: str, layers: int = 1, vocab: int = 32768) -> dict:
    hf = Path(workdir) / f"hf_{layers}_{vocab}"
    if not (hf / "config.json").is_file():
        subprocess.run([sys.executable, "-c", WRITE_WITH_VOCAB, str(hf), str(layers), str(ROOT), str(vocab)],
                       check=True)
    on_disk = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    gib = 2**30
    results = {}
    for way in ("mxfp4", "compute"):
        proc = subprocess.run([sys.executable, "-c", MEASURE, str(hf), way, str(ROOT)], check=True,
                              capture_output=True, text=True)
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
        results[way] = json.loads(line.removeprefix("RESULT "))
        r = results[way]
        print(f"{way:8s} base of {layers} layer(s) ({on_disk / 1e9:.2f} GB on disk): model {r['model_bytes'] / gib:.2f} GiB, "
              f"RssAnon peak {r['above_baseline_bytes'] / gib:.2f} GiB above the baseline "
              f"({r['baseline_bytes'] / gib:.2f} GiB), {r['seconds']:.1f} s", flush=True)
    ratio = results["compute"]["above_baseline_bytes"] / max(results["mxfp4"]["above_baseline_bytes"], 1)
    print(f"compute / mxfp4 peak above baseline: {ratio:.1f}x")
    return results


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:4]))
