"""Which transformers causal-LM families train here and which are refused, and why: every model
type transformers registers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) shrunk to a tiny config
(tests/transformers_configs.py `tiny_config`, or the named sweep's own config) and run through
the sweep of `make test` (`sweep_family`: built with the load-time check against transformers'
eager forward on packed documents longer than the window, its description without weights, one
cached greedy step, the optimizer's parameter groups), each family in its own process. Writes
the table between the markers of docs/own-model.md ("Every registered family").

    python scripts/transformers_families.py [--only llama,mistral] [--timeout 300] [--json out.json]
"""
import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
DOC = ROOT / "docs" / "own-model.md"
BEGIN, END = "<!-- families table: scripts/transformers_families.py -->", "<!-- end of the families table -->"
# Parameters beyond which the generic shrinking missed the family's own field names (a model too
# big for a one-second check): listed as not checked rather than built.
MAX_PARAMS = 20_000_000


def one(model_type: str) -> dict:
    """The sweep of one model type: {"answer": trains | refused | not checked | crash | WRONG, "why"}."""
    from tests.transformers_configs import FAMILIES, family_config, sweep_family, tiny_config
    from torch_model.transformers_lm import TransformersSpec, UnsupportedModel

    try:
        config = family_config(model_type) if model_type in FAMILIES else tiny_config(model_type)
    except Exception as e:  # noqa: BLE001 - a config class that cannot be built with its defaults
        return {"answer": "not checked", "why": f"its config cannot be built with its defaults ({type(e).__name__})"}
    try:
        params = TransformersSpec(config).param_counts()["total"]
    except UnsupportedModel as e:
        return {"answer": "refused", "why": str(e)}
    except Exception as e:  # noqa: BLE001 - the product must answer in one line; a traceback is a finding
        return {"answer": "crash", "why": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    if params > MAX_PARAMS:
        return {"answer": "not checked", "why": f"the sweep's generic shrinking leaves {params / 1e6:.0f} M parameters"}
    try:
        result = sweep_family(config)
    except Exception as e:  # noqa: BLE001
        return {"answer": "crash", "why": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    if result["verdict"] != "trains":
        return {"answer": "refused", "why": result["verdict"]}
    if not result["cached_error"] <= 1e-5:
        return {"answer": "WRONG", "why": f"cached generation differs from transformers ({result['cached_error']:.3g})"}
    if result["optimizer"]:
        return {"answer": "refused" if result["optimizer_one_line"] else "crash",
                "why": f"optimizer groups: {result['optimizer']}"}
    windows = sorted(set(result["windows"]) - {0})
    return {"answer": "trains", "why": f"window {'/'.join(map(str, windows))}" if windows else ""}


def table(results: dict) -> str:
    order = {"trains": 0, "refused": 1, "not checked": 2, "crash": 3, "WRONG": 4}
    counts = {a: sum(r["answer"] == a for r in results.values()) for a in order}
    lines = [f"{len(results)} causal-LM model types registered in transformers "
             f"{__import__('transformers').__version__}: "
             + ", ".join(f"{n} {a}" for a, n in counts.items() if n) + ".", "",
             "| model type | answer | why |", "|---|---|---|"]
    for model_type, r in sorted(results.items(), key=lambda kv: (order[kv[1]["answer"]], kv[0])):
        why = r["why"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {model_type} | {r['answer']} | {why[:300]} |")
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


def worker(types: list[str]) -> None:
    """The child: one RESULT line per model type, in order (one process for many, as long as none
    crashes it)."""
    for model_type in types:
        print(f"START {model_type}", flush=True)
        print("RESULT " + json.dumps({"type": model_type, **one(model_type)}), flush=True)


def sweep(types: list[str], timeout: float) -> dict:
    """Each model type through `one` in a child process, restarted after a crash or a family that
    takes longer than `timeout` seconds."""
    results, todo = {}, list(types)
    while todo:
        child = subprocess.Popen([sys.executable, __file__, "--worker", ",".join(todo)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
        current, started = None, time.time()
        while True:
            ready, _, _ = select.select([child.stdout], [], [], max(1.0, timeout - (time.time() - started)))
            if not ready:                                           # the current family ran past the timeout
                child.kill()
                results[current or todo[0]] = {"answer": "not checked", "why": f"the sweep took over {timeout:.0f} s"}
                break
            line = child.stdout.readline()
            if not line:                                            # the child died
                if current is not None:
                    results[current] = {"answer": "crash", "why": f"the process died (exit {child.wait()})"}
                break
            if line.startswith("START "):
                current, started = line.split()[1], time.time()
            elif line.startswith("RESULT "):
                r = json.loads(line[7:])
                results[r.pop("type")] = r
                print(f"{current}: {r['answer']} {r['why'][:150]}", file=sys.stderr, flush=True)
                current = None
        child.wait()
        todo = [t for t in todo if t not in results]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated model types (default: every registered one)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per family")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--no-doc", action="store_true", help="print the table, leave docs/own-model.md")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker.split(","))
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    results = sweep(args.only.split(",") if args.only else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES), args.timeout)
    text = table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.no_doc or args.only:
        print(text)
    else:
        write_doc(text)


if __name__ == "__main__":
    main()
