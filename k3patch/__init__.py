"""k3patch: apply, audit and revert the Kimi-K3 fixes in a vLLM tree.

The library API (no printing, no exits): `k3patch.tree.locate`, `k3patch.scan.scan`,
`k3patch.engine.apply`, `k3patch.engine.revert`, `k3patch.verify.verify`.
"""

from k3patch.version import VERSION as __version__

__all__ = ["__version__"]
