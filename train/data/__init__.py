"""Data: inputs and the bundled corpus -> tokenizer -> ArrayRecord shards + manifest (prepare), their
integrity (verify), the packing plan and the loader that feeds training (their benchmark: train/bench/data.py).

One module per job: corpus (bundled Shakespeare), pinned_download (files taken from PyPI), inputs
(files, formats, work units), shards (format, manifest, integrity, random access), packing, loader,
prepare, verify. The tokenizer is `formats.tokenizer` (a checkpoint carries it too).
"""
