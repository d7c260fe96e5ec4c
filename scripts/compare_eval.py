"""Compare two `torchlyra eval --tasks --json` files example by example (e.g. the compiled scorer
against `--scorer eager` on a smaller --limit): the worst relative difference of the log-likelihoods
both hold, and how many examples agree on correct / wrong.

    python scripts/compare_eval.py compiled.json eager.json
"""
import json
import sys


def main(first: str, second: str) -> None:
    a = {t["task"]: t for t in json.load(open(first))["tasks"]}
    b = {t["task"]: t for t in json.load(open(second))["tasks"]}
    worst, compared, agree, examples = 0.0, 0, 0, 0
    for name in sorted(set(a) & set(b)):
        for x, y in zip(a[name]["per_example"], b[name]["per_example"]):   # the first N of each task
            xs, ys = x.get("logprobs", [x.get("logprob")]), y.get("logprobs", [y.get("logprob")])
            for u, v in zip(xs, ys):
                if u is not None and v is not None:
                    worst, compared = max(worst, abs(u - v) / max(abs(v), 1e-12)), compared + 1
            agree, examples = agree + (x["correct"] == y["correct"]), examples + 1
    print(f"{compared} log-likelihoods compared, worst relative difference {worst:.2e}; "
          f"{agree}/{examples} examples agree on correct / wrong")


if __name__ == "__main__":
    main(*sys.argv[1:3])
