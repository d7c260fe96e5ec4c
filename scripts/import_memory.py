"""Peak anonymous memory (RssAnon) and throughput of `torchlyra import` on a synthetic checkpoint in
gpt-oss's released layout (gpt-oss-20b's tensor shapes, fewer layers: MXFP4 experts, bf16 rest,
one tensor per shard), as the README's "Start from gpt-oss" reports them:

    python scripts/import_memory.py WORKDIR [N_LAYERS]      (2 layers: 3.3 GB of input)

The synthetic directory is written by a child process; a second child imports it while a thread
samples its own /proc/self/status every 10 ms. The baseline is RssAnon after every import
(torch, jax, orbax, transformers' config) and before the first tensor is read. safetensors'
memory-mapped pages are file-backed and do not count in RssAnon.
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WRITE = r"""
import json, sys
from pathlib import Path
import numpy as np, torch, safetensors.torch
sys.path.insert(0, sys.argv[3])
from formats import hf_mapping
from torch_model.config import get_preset
out, layers = Path(sys.argv[1]), int(sys.argv[2])
overrides = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}   # e.g. {"n_experts": 4, "vocab_size": 32768}
cfg = get_preset("gpt-oss-20b").replace(n_layers=layers, layer_types=["sliding_attention", "full_attention"][:layers] * (layers // 2 or 1),
                                        **overrides)
rng = np.random.default_rng(0)
out.mkdir(parents=True)
weight_map = {}
names = list(hf_mapping.hf_shapes(cfg).items())
for i, (name, shape) in enumerate(names):
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        e, k, n = shape
        tensors = {name + "_blocks": torch.from_numpy(rng.integers(0, 256, (e, n, k // 32, 16), dtype=np.uint8)),
                   name + "_scales": torch.from_numpy(rng.integers(118, 124, (e, n, k // 32), dtype=np.uint8))}
    else:
        tensors = {name: (torch.randn(shape, dtype=torch.float32) * 0.02).bfloat16()}
    file = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
    safetensors.torch.save_file(tensors, str(out / file), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(tensors, file))
    del tensors
(out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
config = hf_mapping.build_hf_config(cfg, dtype="bfloat16").to_dict()
config.pop("torchlyra")
config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                 "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
(out / "config.json").write_text(json.dumps(config))
"""

# A child's RssAnon sampler (every 10 ms on a thread), started after its imports: `baseline`,
# `peak[0]`; `running[0] = False` stops it. Shared with scripts/mxfp4_base_memory.py.
SAMPLER = r"""
def rss_anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

peak, running = [0], [True]
def sample():
    while running[0]:
        peak[0] = max(peak[0], rss_anon())
        time.sleep(0.01)
baseline = rss_anon()
thread = threading.Thread(target=sample, daemon=True)
thread.start()
"""

MEASURE = r"""
import json, sys, threading, time
sys.path.insert(0, sys.argv[3])
import jax, orbax.checkpoint, transformers  # noqa: F401  (everything import_hf needs, loaded first)
from formats import hf_import
from orbax.checkpoint.experimental.v1 import partial  # noqa: F401
""" + SAMPLER + r"""
summary = hf_import.import_hf(sys.argv[1], sys.argv[2], overwrite=True)
running[0] = False
thread.join()
print("RESULT " + json.dumps({"baseline_bytes": baseline, "peak_bytes": peak[0], "above_baseline_bytes": peak[0] - baseline,
                              "input_bytes": summary["input_bytes"], "seconds": summary["seconds"]}))
"""


def main(workdir: str, layers: int = 2) -> dict:
    work = Path(workdir)
    hf, ck = work / "hf", work / "ck"
    if not (hf / "config.json").is_file():
        subprocess.run([sys.executable, "-c", WRITE, str(hf), str(layers), str(ROOT)], check=True)
    on_disk = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(hf), str(ck), str(ROOT)], check=True,
                          capture_output=True, text=True)
    result = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT ")).removeprefix("RESULT "))
    result["on_disk_bytes"] = on_disk
    gib = 2**30
    print(f"input {on_disk / 1e9:.2f} GB on disk ({layers} layers of gpt-oss-20b); import took {result['seconds']:.1f} s: "
          f"{result['input_bytes'] / 1e9 / result['seconds']:.3f} GB/s; RssAnon baseline "
          f"{result['baseline_bytes'] / gib:.2f} GiB, peak {result['peak_bytes'] / gib:.2f} GiB, "
          f"{result['above_baseline_bytes'] / gib:.2f} GiB above the baseline")
    return result


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
