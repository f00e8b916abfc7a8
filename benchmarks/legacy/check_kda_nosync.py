"""Older-way baseline: is the 'k3-kda-nosync' marker in model_executor/layers/mamba/ops/gather_initial_states.py? (substring check, one interpreter)"""

import sys

with open(
    sys.argv[1] + "/model_executor/layers/mamba/ops/gather_initial_states.py", encoding="utf-8"
) as handle:
    sys.exit(0 if "k3-kda-nosync" in handle.read() else 1)
