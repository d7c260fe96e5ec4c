"""Everything a user runs: the `torchlyra` command table (`cli`), a training run (`run`), its
cluster side (`cluster`), data (`data`), evaluation (`evaluation`), generation (`generation`) and
the benchmarks (`bench`). Checkpoints are read and written by `formats`, below this package."""
