"""One folder (or module) per patch, each defining a `Patch` subclass and `PATCH`; installed as
`k3patch.patches`. `TARGETS`: every file (under the vllm package dir) some patch's `files` names,
hashed by the no-op path without importing a patch; the registry checks it is exactly their union.
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
