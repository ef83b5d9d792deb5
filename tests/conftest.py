"""Test-wide settings."""

import torch

# Tiny models: one thread avoids thread start-up and contention costs that dwarf the matmuls
# (and keeps the suite fast on a 2-core CI machine).
torch.set_num_threads(1)
