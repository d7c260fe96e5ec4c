import os
import sys

# Tests run on CPU; keep XLA from grabbing every core's worth of threads in parallel tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Generation enables JAX's persistent compilation cache by default; tests that want it pass a
# directory of their own, the rest leave the user's cache alone.
os.environ.setdefault("TORCHLYRA_COMPILE_CACHE", "off")
