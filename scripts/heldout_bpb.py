"""Bits per byte of a checkpoint on whole text files, each tokenized with the checkpoint's own
tokenizer, in non-overlapping windows of 256 predicted tokens led by BOS (eager torch, CPU), so
models with different tokenizers compare. Used for BENCHMARKS.md's "Whole documents in the demo corpus":

    python scripts/heldout_bpb.py runs/tiny/checkpoint PLAY.txt [PLAY.txt ...]
"""
import sys, json, math
import torch
from formats.checkpoint import load_checkpoint, tokenizer_dir
from torch_model.model import GptOssForCausalLM

def load_tok(d):
    try:
        from formats.tokenizer import load_tokenizer
    except ImportError:  # a checkout from before train/data/ (the "before" run)
        from formats.tokenizer import load_tokenizer
    return load_tokenizer(d)

ckpt, plays = sys.argv[1], sys.argv[2:]
state, cfg, meta = load_checkpoint(ckpt)
model = GptOssForCausalLM(cfg); model.load_state_dict(state); model.eval()
enc = load_tok(tokenizer_dir(ckpt, meta))
bos = cfg.bos_token_id
nats, nbytes, ntok = 0.0, 0, 0
windows = []
for path in plays:
    text = open(path).read()
    ids = [bos] + enc.encode_ordinary(text)
    nbytes += len(text.encode())
    windows += [ids[s:s + 257] for s in range(0, len(ids) - 1, 256)]
full = [w for w in windows if len(w) == 257]
rest = [w for w in windows if len(w) < 257]
with torch.no_grad():
    for i in range(0, len(full), 32):
        b = torch.tensor(full[i:i + 32])
        logits = model(b[:, :-1])
        nats += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), b[:, 1:].reshape(-1), reduction="sum").item()
        ntok += b[:, 1:].numel()
    for w in rest:
        b = torch.tensor([w])
        logits = model(b[:, :-1])
        nats += torch.nn.functional.cross_entropy(logits[0].float(), b[0, 1:], reduction="sum").item()
        ntok += b.shape[1] - 1
print(json.dumps({"checkpoint": ckpt, "bits_per_byte": nats / nbytes / math.log(2), "nats_per_token": nats / ntok,
                  "tokens": ntok, "bytes": nbytes}))
