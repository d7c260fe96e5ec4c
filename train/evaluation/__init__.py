"""Evaluation: validation loss and bits per byte (`validation`), and task evaluation (scoring
requests, tasks, report cards) built on the compiled model."""
