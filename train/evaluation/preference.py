"""Held-out preference pairs during a DPO run: the DPO loss and TRL's reward metrics over a fixed
list of validation batches, with the train step's own objective (jax_bridge/preference.py):
sums over every valid pair of the split's batches, divided by their number."""
from __future__ import annotations

import numpy as np

from formats.errors import UserError
from torch_model.preference import METRICS


class PreferenceEvaluator:
    """val_loss (the mean DPO loss per pair, router losses left out), val_pairs and val_<metric>
    for each of TRL's metrics, e.g. val_rewards/accuracies."""

    def __init__(self, step, batches: list[dict]):
        if not batches:
            raise UserError("evaluation: the validation split gave no batch of preference pairs")
        self.step, self.batches = step, batches

    def __call__(self, params) -> dict:
        import jax

        keys = ("dpo_loss", "pairs", *METRICS)
        totals = np.zeros(len(keys), np.float64)
        for batch in self.batches:       # this process's rows; the step's sums are over the global batch
            out = jax.device_get(self.step.evaluate(params, batch))
            totals += np.array([float(out[k]) for k in keys])
        pairs = max(totals[1], 1.0)
        result = {"val_loss": totals[0] / pairs, "val_pairs": int(totals[1])}
        result.update({f"val_{k}": totals[2 + i] / pairs for i, k in enumerate(METRICS)})
        return result
