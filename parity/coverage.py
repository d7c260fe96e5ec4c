"""Which mask and tiling cases a parity run exercised, per kernel set (printed in the report).

Computed from the model's windows, the sequence length and the tile sizes each implementation
will use (its options or its defaults), with the kernels' own block planning
(`pallas_kernels.attention`), so the printout says what the kernels actually ran:
attention tiles that are skipped (outside the causal/sliding band), masked by the sliding
window, masked only on the causal diagonal, fully visible, and partial (padding past the end);
cross-entropy token/vocabulary tiles and ignored labels; MoE row tiles. With segment ids (packed
rows), how many band tiles a segment boundary masks or lets the kernel skip.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pallas_kernels import attention as attn
from pallas_kernels.platform import kernel_mode
from torch_model.causal_lm import IGNORE_INDEX


def attention_tiles(seq_len: int, window: int, block_q: int, block_kv: int, splash: bool = False) -> dict[str, int]:
    """Counts of (q block, kv block) tiles of one head by case, for blocks as the kernel plans
    them (attention_pallas shrinks blocks to the sequence; splash pads the sequence to its
    tiles). window 0: full causal (a window covering the sequence is causal too)."""
    if splash:
        padded = -(-seq_len // max(block_q, block_kv)) * max(block_q, block_kv)
    else:
        block_q, block_kv, padded = attn._plan_blocks(seq_len, block_q, block_kv, kernel_mode("tpu", who="coverage"))
    window = 0 if window >= seq_len else window
    counts = dict(q_blocks=padded // block_q, kv_blocks=padded // block_kv, skipped=0, sliding_masked=0,
                  causal_masked=0, unmasked=0, partial=int(padded != seq_len), block_q=block_q, block_kv=block_kv)
    for i in range(padded // block_q):
        q0, q1 = i * block_q, (i + 1) * block_q - 1
        for j in range(padded // block_kv):
            k0, k1 = j * block_kv, (j + 1) * block_kv - 1
            if k0 > q1 or (window and k1 <= q0 - window):
                counts["skipped"] += 1
            elif window and k0 <= q1 - window:
                counts["sliding_masked"] += 1        # some (query, key) pair of the tile is outside the window
            elif k1 > q0:
                counts["causal_masked"] += 1
            else:
                counts["unmasked"] += 1
    return counts


def _attention_lines(name: str, windows: list[int], seq_len: int, head_dim: int, options: dict) -> list[str]:
    out = []
    for window in windows:
        kind = f"window {window}" if window and window < seq_len else "full causal"
        if name == "xla":
            case = ("sliding masked (keys before the window)" if kind != "full causal" else "causal mask only")
            out.append(f"attention=xla, {kind}: one [T, T] score matrix, {case}; no tiles")
            continue
        if name == "splash":
            sizes = attn.splash_block_sizes(seq_len, head_dim, **options)
            bq, bkv = sizes["block_q"], sizes["block_kv"]
        elif name == "pallas":
            dq, dkv = attn.default_block_sizes(seq_len, head_dim, "tpu")
            bq, bkv = options.get("block_q") or dq, options.get("block_kv") or dkv
        else:
            out.append(f"attention={name}, {kind}: tiling unknown (not a built-in kernel)")
            continue
        c = attention_tiles(seq_len, window, bq, bkv, splash=name == "splash")
        cases = [f"{c[k]} {k.replace('_', ' ')}" for k in ("skipped", "sliding_masked", "causal_masked", "unmasked")]
        text = (f"attention={name}, {kind}: blocks q {c['block_q']} x kv {c['block_kv']}, grid {c['q_blocks']} x "
                f"{c['kv_blocks']} tiles: {', '.join(cases)}; partial last block: {'yes' if c['partial'] else 'no'}")
        missing = [k.replace("_", " ") for k in ("skipped", "sliding_masked") if kind != "full causal" and not c[k]]
        if c["q_blocks"] * c["kv_blocks"] == 1:
            missing.append("multi-block")
        if missing:
            text += f"; NOT exercised: {', '.join(missing)}"
            if name == "splash":
                text += " (splash tiles are multiples of 128: needs seq_len > 128, e.g. --seq-len 384)"
        out.append(text)
    return out


def segment_lines(name: str, windows: list[int], segment_ids: np.ndarray, head_dim: int, options: dict) -> list[str]:
    """What segment ids [B, T] did to the attention tiles: pallas skips the band tiles whose
    queries and keys share no id and masks the rest; splash masks inside tiles, skips none."""
    segment_ids = np.asarray(segment_ids)
    seq_len = segment_ids.shape[1]
    counts = [len(np.unique(row)) for row in segment_ids]
    head = f"attention={name}, segments ({min(counts)}-{max(counts)} ids per row)"
    if name == "xla":
        return [f"{head}: equal-id mask on the [T, T] scores; no tiles"]
    if name == "splash":
        return [f"{head}: splash SegmentIds mask inside its tiles; tiles skipped by segments: none "
                f"(its block sparsity is the static mask's)"]
    if name != "pallas":
        return [f"{head}: tiling unknown (not a built-in kernel)"]
    out = []
    for window in windows:
        kind = f"window {window}" if window and window < seq_len else "full causal"
        dq, dkv = attn.default_block_sizes(seq_len, head_dim, "tpu")
        c = attn.segment_tile_counts(segment_ids, sliding_window=window, block_q=options.get("block_q") or dq,
                                     block_kv=options.get("block_kv") or dkv)
        text = (f"{head}, {kind}: of {c['band']} band tiles (all rows) {c['skipped']} skipped (no shared id), "
                f"{c['visited']} visited and masked by id")
        if not c["skipped"]:
            text += "; NOT exercised: segment skipping (segments shorter than a tile pair, or one per row)"
        out.append(text)
    return out


def describe(kernels: Mapping[str, str], model_cfg, batch: int, seq_len: int, options: Mapping,
             labels: np.ndarray, experts: list | None = None, segment_ids: np.ndarray | None = None) -> list[str]:
    """Lines naming the mask / tile cases each op of this kernel set exercised. `experts`: per MoE
    layer the chosen experts [tokens, k] (the eager routing), to count expert groups that start
    inside a row tile. `segment_ids` [B, T]: the batch's packed segments, if any."""
    options = {op: dict(per.get(kernels[op], {})) for op, per in (options or {}).items() if op in kernels}
    windows = sorted({model_cfg.window_of_layer(i) for i in range(model_cfg.n_layers)}, reverse=True)
    lines = _attention_lines(kernels["attention"], windows, seq_len, model_cfg.head_dim, options.get("attention", {}))
    if segment_ids is not None:
        lines += segment_lines(kernels["attention"], windows, segment_ids, model_cfg.head_dim,
                               options.get("attention", {}))
    n = batch * seq_len
    ignored = int(np.sum(labels == IGNORE_INDEX))
    ce, ce_opts = kernels["cross_entropy"], options.get("cross_entropy", {})
    if ce == "pallas":
        bn, bv = ce_opts.get("block_n"), ce_opts.get("block_v")
        tiles = (f"{-(-n // bn)} token tiles of {bn}" if bn else "default token tiles") + ", " + \
                (f"{-(-model_cfg.vocab_size // bv)} vocab tiles of {bv}" if bv else "default vocab tiles")
        partial = bn and n % bn
        lines.append(f"cross_entropy=pallas: {n} tokens, {tiles}{', partial token tile' if partial else ''}; "
                     f"{ignored} ignored labels")
    else:
        lines.append(f"cross_entropy={ce}: {n} tokens, {ignored} ignored labels")
    if model_cfg.is_moe:
        rows = n * model_cfg.experts_per_token
        moe, bm = kernels["moe"], options.get("moe", {}).get("block_m")
        if not bm:
            tiling = "no row-tile option (the implementation's own tiling)"
        else:
            tiling = f"row tiles of {bm} ({-(-rows // bm)} tiles)"
            if experts:
                starts = [np.cumsum(np.bincount(np.asarray(e).ravel(), minlength=model_cfg.n_experts))[:-1]
                          for e in experts]
                mid = sum(int(np.sum(s % bm != 0)) for s in starts)
                tiling += f"; {mid} of {sum(len(s) for s in starts)} expert groups start inside a tile"
        lines.append(f"moe={moe}: {rows} routed rows over {model_cfg.n_experts} experts, {tiling}")
    return lines
