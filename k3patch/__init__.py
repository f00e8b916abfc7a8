"""k3patch: apply, audit and revert the Kimi-K3 fixes in a vLLM tree.

The library API (no printing, no exits): `k3patch.tree.locate`, `k3patch.scan.scan`,
`k3patch.engine.apply`, `k3patch.engine.revert`, `k3patch.verify.verify`.
"""

__version__ = "0.1.0"
