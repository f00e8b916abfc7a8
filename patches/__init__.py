"""One folder (or module) per patch. Each defines a `Patch` subclass and a module-level `PATCH`.

Installed as `k3patch.patches`; the engine discovers the patches here and knows none by name.

`TARGETS` is every file (relative to the vllm package dir) that some patch's `files` names. The
no-op path hashes exactly these without importing a patch; the registry checks, whenever it
loads the patches, that the union of their `files` is this table, and refuses to run otherwise.
A patch that reads a new file adds it here.
"""

TARGETS = (
    "_aiter_ops.py",
    "platforms/rocm.py",
    "model_executor/layers/mamba/ops/gather_initial_states.py",
    "models/kimi_k3/amd/ops/kda_prefill.py",
    "models/kimi_k3/amd/kda.py",
    "distributed/kv_transfer/kv_connector/v1/moriio/moriio_common.py",
    "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
    "distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
)
