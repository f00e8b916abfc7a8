"""Older-way baseline: is the 'k3-aiter-mla' marker in _aiter_ops.py? (substring check, one interpreter)"""

import sys

with open(sys.argv[1] + "/_aiter_ops.py", encoding="utf-8") as handle:
    sys.exit(0 if "k3-aiter-mla" in handle.read() else 1)
