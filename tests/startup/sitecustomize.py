"""Run at start-up by every Python process of the test suite: tests/conftest.py imports it and puts
this folder on PYTHONPATH, where Python's `site` imports a `sitecustomize` module by that name.

Tracing and lowering programs (a third of the suite's compile time) allocate many small objects,
and the cyclic garbage collector's default thresholds (700, 10, 10) make it scan them over and
over: raised, a Pallas train step traces in 2.6 s instead of 3.4 s and lowers in 1.1 s instead of
1.4 s (the suite's tiny step: 8.2 -> 7.5 s of CPU for the whole process). Only the tests' processes
take it; users' runs keep Python's defaults."""
import gc

gc.set_threshold(50_000, 50, 100)
