#!/usr/bin/env python3
"""tokamax's Mosaic kernels as `bench kernels` runs them beside ours on a TPU
(train/bench/kernel_peers.py), compiled forward and backward in one program for one v5e chip by
the real TPU compiler on this host (deviceless: nothing runs): per op and shape set, whether it
compiles and the HBM temporaries it keeps. The sliding-window attention cases are left out: its
kernel refuses them (tests/test_tpu_compile.py).

    python3 scripts/tokamax_compile.py [--shapes lyra-small,gpt-oss-20b]
"""
import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="lyra-small,gpt-oss-20b")
    args = parser.parse_args(argv)
    import jax

    from jax_bridge import tpu_compile
    from pallas_kernels.memory import vjp_program
    from train.bench import kernel_peers
    from train.bench.kernel_cases import concrete_inputs, kernel_cases

    device = tpu_compile.device_of("v5e:2x2")
    for shape in args.shapes.split(","):
        for op in ("attention", "moe", "cross_entropy"):
            peer = kernel_peers.peer_of(op)
            for case in [c for c in kernel_cases(op, shape) if not c.dims.get("window")]:
                fn = functools.partial(peer.build(case, kernel_peers.implementation(op, "tpu")), **case.kwargs)
                inputs = jax.eval_shape(lambda: peer.prepare(case, concrete_inputs(case)))
                try:
                    with jax.default_device(device):       # tokamax checks the default device
                        outs = jax.tree.leaves(jax.eval_shape(fn, *inputs))
                        program = vjp_program(fn, peer.floats(case), n_inputs=len(inputs))
                        specs = list(inputs) + [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
                        _, stats = tpu_compile.compile_for(program, specs, device)
                    print(f"{shape} {op} {case.label}: compiles, {stats.temp_bytes / 2**20:.0f} MiB of HBM "
                          f"temporaries, {len(stats.kernels)} kernels", flush=True)
                except Exception as e:  # noqa: BLE001 - a refusal (out of HBM) is the result
                    print(f"{shape} {op} {case.label}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
