import os
import sys

# Tests run on CPU; keep XLA from grabbing every core's worth of threads in parallel tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
