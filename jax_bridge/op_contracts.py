"""Every op's contract: what an implementation in the registry is called with and must return.

One declaration per op (`CONTRACTS`): its positional arguments, its keywords (each with the
contract version that added it and, for a keyword added after version 1, the default that
reproduces the op before it), its return value, what the train step differentiates, and the
platforms an implementation may claim, with a numbered changelog. `read_signature` reads a
function against the version it was written for: what is missing or extra, and how to call it
(`CallPlan`); the registry refuses by name what does not fit (`registry.register_implementation`)
and omits, while they are at their default, the keywords an older implementation does not take.
docs/kernels.md's contract tables are `markdown()` of this declaration (a test keeps them equal).

Evolving an op: a new keyword is one `Keyword(..., since=N + 1, default=...)` line, whose default
reproduces the op before it (None, 0.0, ...: an implementation written for version N is then
called without it while the keyword is at that value and refused by name otherwise; a keyword
without such a value, `default=REQUIRED`, refuses older implementations at registration), plus
one `Version(N + 1, ...)` line; then `python -m jax_bridge.op_contracts` rewrites docs/kernels.md's
tables.
Positional arguments never change within an op.
"""
from __future__ import annotations

import inspect
import numbers
from dataclasses import dataclass, replace
from typing import Any, Callable

from pallas_kernels.platform import PLATFORMS


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()      # a keyword the model always gives (no default)
TARGET_KEYWORD = "platform"  # what the registry passes besides the contract (the platform compiled for)


@dataclass(frozen=True)
class Arg:
    """A positional argument (or a returned array): its name, shape and dtype in words, meaning."""
    name: str
    shape: str
    dtype: str
    meaning: str = ""


@dataclass(frozen=True)
class Keyword:
    """A keyword argument the op passes. `since`: the contract version that added it. `default`:
    what the model passes when it says nothing, which for a keyword added after version 1 is the
    value that reproduces the op before it (REQUIRED: none does, or the model always gives it).
    `needed_by`: in words, what a call with another value is (for the refusal of an older
    implementation)."""
    name: str
    type: str
    meaning: str
    since: int = 1
    default: Any = REQUIRED
    needed_by: str = ""


@dataclass(frozen=True)
class Version:
    number: int
    commit: str
    note: str


@dataclass(frozen=True)
class OpContract:
    op: str
    summary: str
    reference: str                     # the plain-JAX reference ("module:function"): the oracle
    args: tuple[Arg, ...]
    keywords: tuple[Keyword, ...]
    returns: tuple[Arg, ...]
    gradients: str                     # what the train step differentiates (custom VJP expectations)
    versions: tuple[Version, ...]
    platforms: tuple[str, ...] = PLATFORMS

    @property
    def version(self) -> int:
        return self.versions[-1].number

    def keyword(self, name: str) -> Keyword:
        return next(k for k in self.keywords if k.name == name)

    def added_in(self, version: int) -> list[str]:
        return [k.name for k in self.keywords if k.since == version]


_FLOAT = "float32 or bfloat16 (the compute dtype)"
_WINDOW = Keyword("sliding_window", "int", "W > 0: query i sees keys i-W+1..i; 0: every key <= i")
_SCALE = Keyword("scale", "float", "multiplies q.k before the softmax")
_ALPHA = Keyword("alpha", "float", "the activation (clip(up, +-limit) + up_shift) * g * sigmoid(alpha g), "
                 "g = min(gate, limit): GPT-OSS 1.702, SwiGLU 1")
_LIMIT = Keyword("limit", "float", "the clamp of gate (above) and up (both sides): GPT-OSS 7, SwiGLU inf")
_UP_SHIFT = Keyword("up_shift", "float", "added to the clipped up projection: GPT-OSS 1, SwiGLU 0", default=1.0,
                    needed_by="experts whose activation is not GPT-OSS's (SwiGLU families: up_shift 0)")
_EXPERTS_GRAD = "with respect to x, gate_up, gate_up_bias, down and down_bias (group_sizes: integers, no cotangent)"

CONTRACTS: dict[str, OpContract] = {c.op: c for c in (
    OpContract(
        "attention", "causal GQA attention with one learned sink logit per query head (the train step's "
        "attention)", "pallas_kernels.attention:attention_reference",
        args=(Arg("q", "[B, Hq, Tq, D]", _FLOAT, "queries: the last Tq of the Tk positions"),
              Arg("k", "[B, Hkv, Tk, D]", "q's", "keys; Hq a multiple of Hkv"),
              Arg("v", "[B, Hkv, Tk, D]", "q's", "values"),
              Arg("sinks", "[Hq]", "q's", "one sink logit per query head: joins each score row before the "
                  "softmax, dropped after")),
        keywords=(_WINDOW, _SCALE,
                  Keyword("segment_ids", "int32 [B, T] or None", "query i sees key j only when their ids are "
                          "equal (Tq == Tk); None: one segment per row", since=2, default=None,
                          needed_by="segment-masked (packed) batches")),
        returns=(Arg("out", "[B, Hq, Tq, D]", "q's"),),
        gradients="with respect to q, k, v and sinks (a custom VJP gives all four)",
        versions=(Version(1, "736cfad", "the first registry"),
                  Version(2, "b5f340b", "packed conversations and --document-masking"))),
    OpContract(
        "cross_entropy", "per-token loss of the LM head without handing logits back: nll and log-sum-exp of "
        "hidden @ weight.T", "pallas_kernels.cross_entropy:linear_cross_entropy_reference",
        args=(Arg("hidden", "[N, H]", _FLOAT, "the last hidden states, one row per token"),
              Arg("weight", "[V, H]", "hidden's", "the LM head (or the tied embedding)"),
              Arg("labels", "[N]", "int32", "target ids; ignore_index where a token has none")),
        keywords=(Keyword("ignore_index", "int", "the label of tokens without a target"),),
        returns=(Arg("nll", "[N]", "float32", "-log p(label), 0 at ignored tokens"),
                 Arg("lse", "[N]", "float32", "the logits' log-sum-exp, which the z-loss takes; 0 at ignored "
                     "tokens")),
        gradients="with respect to hidden and weight; cotangents arrive for both nll and lse",
        versions=(Version(1, "736cfad", "the first registry"),)),
    OpContract(
        "moe", "the grouped expert MLP: rows sorted by expert, each expert computes only its own rows "
        "(token dispatch runs around it: jax_bridge/moe_dispatch.py)", "pallas_kernels.moe:moe_experts_reference",
        args=(Arg("x", "[M, H]", _FLOAT, "rows sorted by expert"),
              Arg("group_sizes", "[E]", "int32", "rows of each expert, in order; they may sum to less than M "
                  "(rows past the groups: any output, masked by the caller)"),
              Arg("gate_up", "[E, H, 2I]", "x's", "gate and up projections, interleaved along 2I"),
              Arg("gate_up_bias", "[E, 2I]", "x's", "added to the gate and up projections"),
              Arg("down", "[E, I, H]", "x's", "the down projection"),
              Arg("down_bias", "[E, H]", "x's", "added to the output")),
        keywords=(_ALPHA, _LIMIT,
                  replace(_UP_SHIFT, since=2)),
        returns=(Arg("y", "[M, H]", "x's"),),
        gradients=_EXPERTS_GRAD,
        versions=(Version(1, "736cfad", "the first registry; GPT-OSS's activation, as up_shift 1"),
                  Version(2, "2b6523f", "transformers' MoE families: SwiGLU"))),
    OpContract(
        "moe_mxfp4", "the grouped expert MLP of a frozen base whose expert stacks stay MXFP4 (gpt-oss's "
        "released layout)", "pallas_kernels.moe_mxfp4:moe_mxfp4_reference",
        args=(Arg("x", "[M, H]", _FLOAT, "rows sorted by expert"),
              Arg("group_sizes", "[E]", "int32", "as moe's"),
              Arg("gate_up_blocks", "[E, 2I, H/2]", "uint8", "two E2M1 codes per byte, gate/up interleaved "
                  "along 2I"),
              Arg("gate_up_scales", "[E, 2I, H/32]", "uint8", "2**(byte - 127) per 32 values"),
              Arg("gate_up_bias", "[E, 2I]", "bfloat16 or x's", "as moe's"),
              Arg("down_blocks", "[E, H, I/2]", "uint8", "the down projection (transposed), two codes per byte"),
              Arg("down_scales", "[E, H, I/32]", "uint8", "its scales"),
              Arg("down_bias", "[E, H]", "bfloat16 or x's", "as moe's")),
        keywords=(_ALPHA, _LIMIT, _UP_SHIFT),
        returns=(Arg("y", "[M, H]", "x's"),),
        gradients="with respect to x only: the stacks and their biases are a frozen base (their cotangents are "
                  "not used)",
        versions=(Version(1, "5834f44", "the first MXFP4 expert op, with moe's v2 keywords"),)),
    OpContract(
        "cached_attention", "attention of new queries over a KV cache (generation only), causal or sliding "
        "by token position", "pallas_kernels.decode_attention:cached_attention_reference",
        args=(Arg("q", "[B, Hq, Tq, D]", _FLOAT, "the new tokens' queries"),
              Arg("k", "[B, Hkv, S, D]", "q's", "the cache's keys, slots in any order"),
              Arg("v", "[B, Hkv, S, D]", "q's", "the cache's values"),
              Arg("sinks", "[Hq]", "q's", "as attention's"),
              Arg("q_positions", "[B, Tq]", "int32", "each query's token position"),
              Arg("k_positions", "[B, S]", "int32", "each slot's token position, -1 for an empty or padding "
                  "slot (never seen)")),
        keywords=(_WINDOW, _SCALE),
        returns=(Arg("out", "[B, Hq, Tq, D]", "q's"),),
        gradients="none: generation only, never differentiated",
        versions=(Version(1, "6b37953", "the KV-cache forward"),)),
)}


def _check_declaration() -> None:
    """The declaration is consistent: versions numbered 1..N, each keyword's version among them,
    keywords of version 1 first in the order the op passes them."""
    for c in CONTRACTS.values():
        assert [v.number for v in c.versions] == list(range(1, len(c.versions) + 1)), c.op
        assert all(1 <= k.since <= c.version for k in c.keywords), c.op
        assert [k.since for k in c.keywords] == sorted(k.since for k in c.keywords), c.op
        assert set(c.platforms) <= set(PLATFORMS), c.op


_check_declaration()


# ---- reading an implementation against its contract --------------------------------------------
@dataclass(frozen=True)
class CallPlan:
    """How the op calls one implementation: `version` (the contract version it was written for),
    `omitted` (keywords added after it that it does not take: keyword -> the default they must
    hold for it to run), `keyword_params` (its keyword parameters: contract keywords, options,
    `platform`) and whether it accepts **kwargs."""
    version: int
    omitted: dict
    keyword_params: frozenset
    var_keyword: bool

    def takes(self, keyword: str) -> bool:
        return keyword not in self.omitted


def read_signature(op: str, fn: Callable, version: int | None = None) -> tuple[CallPlan | None, list[str]]:
    """(the call plan, []) when `fn` can be called by `op` as an implementation written for contract
    `version` (None: the op's current one), else (None, what is missing or extra, in words).

    A contract keyword is taken when the signature names it, or when it has **kwargs and the
    keyword belongs to `version` (accepting **kwargs means taking every keyword of the version it
    was written for, and honouring it). A keyword added after `version` that it does not take is
    omitted while it holds its default; one without a default cannot be omitted."""
    contract = CONTRACTS[op]
    version = contract.version if version is None else version
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= contract.version:
        return None, [f"contract_version must be one of {op}'s versions 1..{contract.version}, found {version!r}"]
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        return None, [f"its signature cannot be read ({e})"]
    n = len(contract.args)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_keyword = any(p.kind == p.VAR_KEYWORD for p in params)
    first = {p.name for p in positional[:n]}
    contract_names = {k.name for k in contract.keywords}
    # What the op can pass by name: every parameter but the positional-only ones and the first n.
    by_keyword = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                           and p.name not in first)
    problems = []
    if len(positional) < n and not any(p.kind == p.VAR_POSITIONAL for p in params):
        problems.append(f"takes {len(positional)} positional argument(s), the op passes {n} "
                        f"({', '.join(a.name for a in contract.args)})")
    clash = sorted(first & contract_names)
    if clash:
        problems.append(f"takes keyword(s) {', '.join(clash)} among its first {n} positional arguments")
    extra = [p.name for p in positional[n:] if p.default is p.empty
             and (p.kind == p.POSITIONAL_ONLY or p.name not in contract_names)]
    extra += [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty
              and p.name not in contract_names and p.name != TARGET_KEYWORD]
    if extra:
        problems.append(f"extra required argument(s) {', '.join(extra)} that the op never passes "
                        f"(an option needs a default)")
    missing, omitted = [], {}
    for k in contract.keywords:
        if k.name in by_keyword or (var_keyword and k.since <= version):
            continue
        if k.since <= version:
            missing.append(k)
        elif k.default is REQUIRED:
            problems.append(f"lacks {k.name}, added in v{k.since} with no value that reproduces v{version}")
        else:
            omitted[k.name] = k.default
    if missing:
        text = f"lacks keyword(s) {', '.join(f'{k.name} (v{k.since})' for k in missing)} that the op passes"
        older = min(k.since for k in missing) - 1
        later = [k for k in contract.keywords if k.since > older and k.name not in by_keyword]
        if older >= 1 and all(k.default is not REQUIRED for k in later):
            text += (f"; if it was written for v{older}, register it with contract_version={older}: it is then "
                     f"called while {', '.join(f'{k.name}={k.default!r}' for k in later)}, and refused by name "
                     f"otherwise")
        problems.append(text)
    if problems:
        return None, problems
    return CallPlan(version, omitted, by_keyword, var_keyword), []


def holds_default(value, default) -> bool:
    """Whether a keyword's value (static at trace time) is its default: None is None; numbers
    compare by value. An array where the default is None is not."""
    if default is None or value is None:
        return value is default
    return isinstance(value, numbers.Number) and bool(value == default)


# ---- docs/kernels.md ----------------------------------------------------------------------------
def _default_text(k: Keyword) -> str:
    return "always given" if k.default is REQUIRED else f"`{k.default!r}`"


def _versions_text(c: OpContract) -> str:
    parts = []
    for v in c.versions:
        added = c.added_in(v.number)
        what = ", ".join(f"`{name}`" for name in added) if v.number == 1 else \
            "+ " + ", ".join(f"`{name}`" for name in added)
        parts.append(f"v{v.number} ({v.commit}, {v.note}): {what or 'no new keyword'}")
    return "; ".join(parts)


def markdown() -> str:
    """Every op's contract as docs/kernels.md shows it (between its `contracts` markers)."""
    out = []
    for c in CONTRACTS.values():
        out += [f"### `{c.op}`, contract v{c.version}", "",
                f"{c.summary[0].upper()}{c.summary[1:]}; the reference: `{c.reference.replace(':', '.')}`.", "",
                "| argument | shape | dtype | meaning |", "| --- | --- | --- | --- |"]
        out += [f"| `{a.name}` | {a.shape} | {a.dtype} | {a.meaning} |" for a in c.args]
        out += ["", "| keyword | type | default | since | meaning |", "| --- | --- | --- | --- | --- |"]
        out += [f"| `{k.name}` | {k.type} | {_default_text(k)} | v{k.since} | {k.meaning} |" for k in c.keywords]
        returns = "; ".join(f"`{r.name}` {r.shape}, {r.dtype} dtype" + (f" ({r.meaning})" if r.meaning else "")
                            for r in c.returns)
        out += ["", f"Returns {returns}. Gradients: {c.gradients}. Platforms: {', '.join(c.platforms)}.", "",
                f"Versions: {_versions_text(c)}.", ""]
    return "\n".join(out).rstrip() + "\n"


DOCS_PAGE = "docs/kernels.md"
BEGIN = "<!-- op contracts: generated by jax_bridge.op_contracts.markdown(), do not edit by hand -->\n"
END = "<!-- end of op contracts -->\n"


def with_tables(page: str) -> str:
    """The text of docs/kernels.md with its contract tables (between BEGIN and END) made `markdown()`."""
    if page.count(BEGIN) != 1 or page.count(END) != 1:
        raise ValueError(f"{DOCS_PAGE} must hold the op-contract markers once each: {BEGIN.strip()} ... {END.strip()}")
    head, rest = page.split(BEGIN)
    return head + BEGIN + markdown() + END + rest.split(END)[1]


if __name__ == "__main__":          # rewrite the page's tables from the declaration
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / DOCS_PAGE
    path.write_text(with_tables(path.read_text()))
    print(f"wrote the op contracts into {path}")
