"""Test-wide settings.

One intra-op thread per process: the models here are tiny, and on the 2-core CI machine several
processes (Ray workers, TP ranks) share the cores; OpenMP threads spinning against each other
made a tiny forward 80x slower.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).parent))
