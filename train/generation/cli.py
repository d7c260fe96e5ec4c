"""The `torchlyra generate` command: prompts (plain text, or harmony chat messages) in, streamed or
batched text out, over the one generation API of generator.py."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import sys
from pathlib import Path

from formats.errors import UserError
from jax_bridge.compile_cache import HELP as COMPILE_CACHE_HELP
from train.generation import chat
from train.generation.generator import Generation, Generator, open_for_generation
from train.generation.sampling import SamplingConfig
from train.generation.text_stream import TextStream
from formats.lora_inference import add_merge_argument
from train.cluster import join


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from formats.model_checks import add_module_arguments

    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint directory written by `torchlyra train` or `import`, or a Hugging Face "
                             "GptOss directory (gpt-oss as released: MXFP4 or bf16)")
    add_module_arguments(parser)
    parser.add_argument("--prompt", action="append", default=None, help="prompt text (repeat for a batch)")
    parser.add_argument("--max-tokens", type=int, default=200, help="new tokens per prompt at most")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=40, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats; 1 = off")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    parser.add_argument("--stop", type=int, action="append", default=None,
                        help="extra stop token id (repeatable; the model's eos always stops)")
    parser.add_argument("--kernels", default="auto",
                        help="kernels, e.g. cached_attention=xla,moe=decode (auto: moe=decode on CPU)")
    parser.add_argument("--mesh", default="",
                        help="device mesh as for train, e.g. fsdp=4,tensor=2 (default: every device on fsdp; "
                             "fsdp runs as tensor as far as the heads divide; the batch is padded to a multiple "
                             "of the devices it is split over)")
    parser.add_argument("--decode-kernels", default=None, help="kernels of the decode loop alone (default: --kernels)")
    parser.add_argument("--kernel-options", default=None,
                        help="per-implementation options or a tile table, as for train (e.g. moe.pallas.block_i=256)")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="print each result at the end instead of streaming a single prompt")
    parser.add_argument("--stream-every", type=int, default=8, help="tokens per streamed chunk (default 8)")
    parser.add_argument("--compile-cache", default=None, help=COMPILE_CACHE_HELP)
    parser.add_argument("--timings", action="store_true",
                        help="print load, compile, prefill and decode times, and the decode's HBM floor (on TPU)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="generate once untimed (compiles), then again under jax.profiler into DIR, and print "
                             "where a decode step's time goes, op category by category beside the roofline "
                             "(`torchlyra profile DIR` prints it again)")
    parser.add_argument("--chat", action="store_true",
                        help="harmony chat format (o200k_harmony models): each --prompt is a user message; "
                             "stops on <|return|> or <|call|>")
    add_merge_argument(parser, base_dtype=True)
    parser.add_argument("--system", default=None, help="with --chat: a system message before each user message")
    parser.add_argument("--messages", default=None,
                        help='with --chat: a JSON file holding one conversation, [{"role": ..., "content": ...}, ...]')
    join.add_arguments(parser)


def run(args) -> int:
    """On several processes every one loads its share of the weights and decodes the same prompts
    in lockstep over the global mesh; process 0 prints."""
    code = join.join(args, "generate")
    if code is not None:          # this process supervised the others
        return code
    from formats.model_checks import take_module_from_args
    from train.startup import Startup

    startup = Startup()       # where the start goes (--timings)
    take_module_from_args(args)
    import jax

    # Every process runs the same calls (streamed chunks included: a stop string ends rows on all);
    # only process 0's output is shown.
    with join.together("generate"):
        startup.start_devices()
        with contextlib.redirect_stdout(io.StringIO()) if jax.process_index() else contextlib.nullcontext():
            return _run(args, startup)


def _run(args, startup) -> int:
    sampling = SamplingConfig(max_new_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    if (args.system or args.messages) and not args.chat:
        raise UserError("--system and --messages need --chat")
    mesh = join.command_mesh(args.mesh)
    model, tokenizer, weights = open_for_generation(args.checkpoint, merge=args.merge, base_dtype=args.base_dtype)
    startup.mark("opening the checkpoint")
    cfg = model.cfg
    if args.chat:
        conversations = chat_conversations(args)
        prompts = [chat.render(tokenizer, c) for c in conversations]
        stops = (*chat.stop_tokens(tokenizer), cfg.eos_token_id)
        labels = [c[-1].content for c in conversations]
    else:
        labels = args.prompt or [""]
        start = [] if cfg.bos_token_id is None else [cfg.bos_token_id]     # a released config may name none
        prompts = [start + tokenizer.encode_ordinary(t) for t in labels]
        stops = (cfg.eos_token_id,)
    stops = tuple(t for t in (*stops, *(args.stop or ())) if t is not None)
    sampling = dataclasses.replace(sampling, stop_tokens=stops)
    generator = Generator(model, kernels=args.kernels, decode_kernels=args.decode_kernels,
                          compile_cache=args.compile_cache, tokenizer=tokenizer, mesh=mesh, weights=weights,
                          kernel_options=args.kernel_options)
    startup.mark("reading and placing the parameters")
    if weights is not None:         # every process says what it read (stdout is process 0's alone)
        import jax

        join.say_inference_mesh("generate", mesh, generator.mesh)
        total = sum(e.nbytes for e in weights.entries.values())
        print(f"{args.checkpoint}: process {jax.process_index()} read {weights.bytes_requested:,} of {total:,} "
              f"stored bytes onto its devices in {generator.load_seconds:.1f} s", file=sys.stderr, flush=True)
    hidden = {cfg.bos_token_id, cfg.eos_token_id}
    streaming = args.stream and len(prompts) == 1
    if streaming:
        stream = chat.ReplyStream(tokenizer) if args.chat else TextStream(tokenizer, skip=hidden)
        print(f"--- prompt: {labels[0]!r}\n" + ("" if args.chat else labels[0]), end="", flush=True)
    if args.profile:              # every program compiled and loaded before the trace starts
        generator.generate(prompts, sampling, stream_every=args.stream_every if streaming else None)
        profiler = DecodeProfiler(args.profile)
    result = generator.generate(prompts, sampling, on_tokens=(lambda new: stream(new[0])) if streaming else None,
                                stream_every=args.stream_every if streaming else None)
    if args.profile:
        profiler.finish(generator, result, sampling)
    if streaming:
        stream.close()
        print("\n")
    else:
        for label, ids in zip(labels, result.tokens):
            text = chat.reply_text(tokenizer, ids)[0] if args.chat else \
                label + tokenizer.decode([t for t in ids if t not in hidden])
            print(f"--- prompt: {label!r}\n{text}\n")
    if args.timings:
        startup.mark("compiling and generating")
        print(format_timings(result, generator.load_seconds), file=sys.stderr)
        print(startup.line(generator.compile_cache), file=sys.stderr)
    return 0


class DecodeProfiler:
    """`generate --profile DIR`: a jax.profiler trace of one generate call and, beside it, the
    decode loop's compiled program with the loop iterations the trace holds, so the profile
    summary (train/run/profile_summary.py) gives a decode step's time per op category beside
    the roofline's prediction for one iteration."""

    def __init__(self, directory):
        import jax

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.directory))

    def finish(self, generator, result: Generation, sampling: SamplingConfig) -> dict:
        """Stop the trace after `result` (a generate call with `sampling`), save its decode program
        beside it and print the summary; returns the summary."""
        import jax

        from jax_bridge.decoding import stop_slots
        from train.run import profile_summary

        jax.profiler.stop_trace()       # generate returned host tokens: the device work is done
        decoder = generator.decoder
        key = (result.bucket[0], result.bucket[2], sampling.mode(generator.cfg.vocab_size),
               stop_slots(len(sampling.stop_tokens)))      # the bucket decode_program compiled it under
        profile_summary.save_program(self.directory, decoder.decode_programs()[key], platform=decoder.platform,
                                     generation=decoder.tpu_generation, loop_steps=result.decode_steps,
                                     compiled_note="the decode loop the generate call ran (compiled before the trace)",
                                     bucket=list(result.bucket), host_seconds=result.decode_seconds)
        summary, path = profile_summary.write_summary(self.directory)
        print(profile_summary.format_summary(summary), file=sys.stderr)
        print(f"profile: {path}", file=sys.stderr)
        return summary


def chat_conversations(args) -> list[list]:
    """--messages FILE: one conversation; else one per --prompt (a user message), each after the
    --system message if given."""
    if args.messages:
        if args.prompt or args.system:
            raise UserError("--messages holds the whole conversation: give no --prompt or --system with it")
        return [chat.read_messages(args.messages)]
    if not args.prompt:
        raise UserError("--chat needs --prompt (a user message, repeatable) or --messages FILE")
    system = [chat.Message("system", args.system)] if args.system else []
    return [system + [chat.Message("user", text)] for text in args.prompt]


def format_timings(result: Generation, load_seconds: float | None = None) -> str:
    """The parameters' load (when read from a checkpoint), compiles, time to first token and the
    decode loop; then what a decode step reads and its HBM floor."""
    compiled = ", ".join(f"{c.program} {c.seconds:.1f} s" + (" (persistent cache)" if c.from_cache else "")
                         for c in result.compilations) or "none (compiled earlier in this process)"
    if result.first_run_seconds:
        compiled += f", first run {result.first_run_seconds:.2f} s"
    load = "" if load_seconds is None else f"load {load_seconds:.1f} s; "
    line = (f"{load}bucket batch={result.bucket[0]} prompt={result.bucket[1]} length={result.bucket[2]}; "
            f"compile: {compiled}; time to first token {1e3 * result.prefill_seconds:.1f} ms; "
            f"decode {result.decode_steps} steps in {result.decode_seconds:.3f} s = "
            f"{result.decode_tokens_per_second:.0f} tokens/s")
    return line + ("\n" + format_floor(result) if result.decode_steps else "")


def format_floor(result: Generation) -> str:
    """What a decode step reads at the least and, on a TPU, the HBM floor that sets and the share of
    it achieved (docs/generate.md: Speed against the HBM floor)."""
    steps = result.decode_steps
    weights, kv = result.decode_weight_bytes / steps, result.decode_kv_bytes / steps
    read = f"{_bytes(weights + kv)} per step (weights {_bytes(weights)}, KV cache {_bytes(kv)} at the rows' lengths)"
    floor = result.floor_seconds
    if floor is None:
        return f"decode reads at the least {read}; its HBM floor is reported on TPU only"
    return (f"decode floor: {read} / {result.hbm_bandwidth / 1e9:.0f} GB/s ({result.tpu_generation} HBM) = "
            f"{1e3 * floor / steps:.2f} ms per step, {result.rows * steps / floor:.0f} tokens/s; achieved "
            f"{100 * result.floor_share:.0f}% ({1e3 * result.decode_seconds / steps:.2f} ms per step)")


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
