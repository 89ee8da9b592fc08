"""Parrot: an OpenAI-compatible server with exact n-gram speculative decoding."""

import os

# OpenMP threads that spin while waiting collapse when another process shares the cores (the
# normal case on small shared machines): measured on 2 cores with one busy neighbour process,
# a 512-token prefill took 0.9-8 s with the default (spinning) policy and 0.95-1.8 s with
# PASSIVE, with no loss when the machine is quiet. Set before torch starts its thread pool;
# an explicit setting from the user wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
