"""Older-way baseline: is the 'k3-group-routing' marker in distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py? (substring check, one interpreter)"""

import sys

with open(
    sys.argv[1] + "/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
    encoding="utf-8",
) as handle:
    sys.exit(0 if "k3-group-routing" in handle.read() else 1)
