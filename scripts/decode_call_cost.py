#!/usr/bin/env python3
"""The fixed cost of a `generate` call's decode, apart from its steps: the median decode time of
calls that decode 1 step and of calls that decode N steps (one prompt, greedy, random weights),
interleaved in one run; the line through the two gives the cost per step and per call.

With --compare-limit-transfer, calls that transfer the decode loop's step limit to the device on
every call (the decoder before 726e4df, which keeps each limit it placed) run interleaved
beside them, and the difference of the two fixed costs is printed. With --compare-first-token-wait,
calls that wait for the first token before dispatching the decode loop (a streamed call with one
chunk, as every call did before the loop was queued behind the prefill) run beside them;
the time to first token and the whole call (prefill and decode) are printed too, since queuing
moves time between the two.

    python scripts/decode_call_cost.py [--preset tiny] [--steps 16] [--repeats 40]
        [--compare-limit-transfer] [--compare-first-token-wait]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=16, help="decode steps of the longer call")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--compare-limit-transfer", action="store_true")
    parser.add_argument("--compare-first-token-wait", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        parser.error("--steps must be >= 2 and --repeats >= 1")

    import jax
    import numpy as np
    import torch

    from jax_bridge import decoding
    from torch_model.config import get_preset
    from torch_model.model import GptOssForCausalLM
    from train.generation.generator import Generator
    from train.generation.sampling import SamplingConfig

    torch.manual_seed(0)
    model = GptOssForCausalLM(get_preset(args.preset)).eval()
    generator = Generator(model, kernels="auto")
    prompt = np.random.default_rng(0).integers(1, model.cfg.vocab_size, (1, 32)).tolist()
    kept = decoding.Decoder.place_limit

    def transferred(decoder, limit):          # placed again on every call, where the kept one lies
        return jax.device_put(np.int32(limit), kept(decoder, limit).sharding)

    queued = lambda sampling: generator.generate(prompt, sampling)
    waits = lambda sampling: generator.generate(prompt, sampling, on_tokens=lambda new: None)
    baseline = "limit kept, loop queued"
    variants = {baseline: (kept, queued)}      # (place_limit, call)
    if args.compare_limit_transfer:
        variants["limit transferred per call"] = (transferred, queued)
    if args.compare_first_token_wait:
        variants["loop dispatched after the first token"] = (kept, waits)
    # Same bucket for both lengths (one pair of programs), compiled before timing.
    calls = {steps: SamplingConfig(max_new_tokens=steps + 1, temperature=0) for steps in (1, args.steps)}
    times = {(name, steps): [] for name in variants for steps in calls}
    # Greedy: every call of a length decodes the same steps (fewer where the model's eos comes first).
    done = {steps: generator.generate(prompt, sampling).decode_steps for steps, sampling in calls.items()}
    if done[args.steps] <= done[1]:
        parser.error(f"the longer call decoded {done[args.steps]} step(s): this model's eos came first; "
                     "try another --preset or --steps")
    for _ in range(args.repeats):
        for name, (place_limit, call) in variants.items():
            decoding.Decoder.place_limit = place_limit
            for steps, sampling in calls.items():
                times[name, steps].append(call(sampling))
    decoding.Decoder.place_limit = kept

    print(f"{args.preset}, 1 prompt, greedy, on {jax.devices()[0].platform}: medians of {args.repeats} interleaved "
          f"calls")
    short, long = done[1], done[args.steps]
    print(f"| variant | {short} step(s) | {long} steps | per step | per call (fixed) | time to first token | "
          f"whole call, {long} steps |")
    print("|---|---|---|---|---|---|---|")
    fixed = {}
    for name in variants:
        one, many = (statistics.median(g.decode_seconds for g in times[name, s]) * 1e3 for s in calls)
        first = statistics.median(g.prefill_seconds for g in times[name, args.steps]) * 1e3
        whole = statistics.median(g.prefill_seconds + g.decode_seconds for g in times[name, args.steps]) * 1e3
        step = (many - one) / (long - short)
        fixed[name] = one - short * step
        print(f"| {name} | {one:.3f} ms | {many:.3f} ms | {step:.3f} ms | {fixed[name]:.3f} ms | {first:.3f} ms | "
              f"{whole:.3f} ms |")
    if args.compare_limit_transfer:
        saved = fixed["limit transferred per call"] - fixed[baseline]
        print(f"keeping the limit: {saved:.3f} ms less per call")
    if args.compare_first_token_wait:
        saved = fixed["loop dispatched after the first token"] - fixed[baseline]
        print(f"queuing the loop: {saved:.3f} ms less fixed decode time per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
