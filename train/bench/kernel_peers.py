"""Another library's kernels, timed beside ours by `bench kernels` on a TPU: tokamax (0.0.12, the
newest release for Python 3.11), whose Mosaic TPU kernels are attention (`dot_product_attention`),
the grouped matmul (`ragged_dot`) and the linear cross-entropy
(`linear_softmax_cross_entropy_loss`).

A peer solves the op's benchmark problem in its library's own layout. The inputs are converted
before the timing, so a transpose is not counted against it. It leaves out what the library
cannot express, and its row says so (`Peer.note`):
- attention: tokamax has no sinks, so the problem is the same attention without them. Its Mosaic
  kernel refuses sliding windows ("mask.k_start is not supported"), so that row records the
  refusal;
- MoE: two tokamax grouped matmuls around the same biases and clamped SwiGLU in XLA, where our
  kernel fuses all of it;
- cross-entropy: the loss summed over tokens; its weight is [H, V], ours [V, H].
Their tiles are tokamax's defaults: no autotuning was run ("autotuning cache miss" in the log).
Elsewhere than a TPU the same functions run tokamax's `xla` implementations, which the tests hold
to our references (tests/test_bench.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from train.bench.kernel_cases import Case, float_positions

LIBRARY = "tokamax"
# tokamax's implementation of each op on a TPU; other platforms run its plain-XLA one.
MOSAIC = {"attention": "mosaic", "moe": "mosaic", "cross_entropy": "mosaic_tpu"}


@dataclass(frozen=True)
class Peer:
    op: str
    name: str
    note: str
    prepare: Callable       # (case, inputs) -> the peer's inputs (converted outside the timed program)
    floats: Callable        # (case) -> positions of the peer's inputs that take gradients
    build: Callable         # (case, implementation) -> fn(*peer inputs)


def version() -> str | None:
    """The installed tokamax's version, or None when it does not import."""
    try:
        from importlib.metadata import version as installed

        import tokamax  # noqa: F401
        return installed("tokamax")
    except Exception:  # noqa: BLE001 - any import failure: no peer rows, said once by the caller
        return None


def _tokamax():
    """tokamax, its absl flags marked parsed at their defaults: its config reads them on first use
    and, when nobody parsed them, parses sys.argv, which holds our command's flags (or pytest's)
    and fails on them ("Unknown command line flag")."""
    from absl import flags

    import tokamax

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    return tokamax


def implementation(op: str, platform: str) -> str:
    return MOSAIC[op] if platform == "tpu" else "xla"


def _attention_inputs(case: Case, inputs):
    """q, k, v [B, H, T, D] -> [B, T, H, D]; the sinks left out."""
    return [x.transpose(0, 2, 1, 3) for x in inputs[:3]]


def _attention(case: Case, impl: str):
    tokamax = _tokamax()
    window = case.dims["window"]

    def fn(q, k, v, **_):       # our window W: keys i-W+1..i, tokamax's (left, right) = (W-1, 0)
        return tokamax.dot_product_attention(q, k, v, scale=case.kwargs["scale"], is_causal=True,
                                             local_window_size=(window - 1, 0) if window else None,
                                             implementation=impl)
    return fn


def _moe(case: Case, impl: str):
    import functools

    from pallas_kernels.moe import experts_around_grouped_matmuls

    grouped_matmul = functools.partial(_tokamax().ragged_dot, implementation=impl)
    return functools.partial(experts_around_grouped_matmuls, grouped_matmul)     # the reference's body


def _cross_entropy_inputs(case: Case, inputs):
    hidden, weight, labels = inputs
    return [hidden, weight.T, labels]


def _cross_entropy(case: Case, impl: str):
    tokamax = _tokamax()

    def fn(hidden, weight_t, labels, **_):
        return tokamax.linear_softmax_cross_entropy_loss(hidden, labels, weight_t, reduction="sum",
                                                         implementation=impl)
    return fn


PEERS = {
    "attention": Peer("attention", LIBRARY, "no sinks (tokamax has none)", _attention_inputs,
                      lambda case: (0, 1, 2), _attention),
    "moe": Peer("moe", LIBRARY, "2 tokamax ragged_dots, biases and SwiGLU in XLA", lambda case, inputs: list(inputs),
                float_positions, _moe),           # our inputs as they are
    "cross_entropy": Peer("cross_entropy", LIBRARY, "loss summed; weight [H, V]", _cross_entropy_inputs,
                          lambda case: (0, 1), _cross_entropy),
}


def peer_of(op: str) -> Peer | None:
    return PEERS.get(op)
