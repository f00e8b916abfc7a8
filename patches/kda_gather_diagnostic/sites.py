"""kda-gather-diagnostic's sites and their declared shapes (SITES.md 3): where the diagnostic may
be, the fork's guard around it, and the diagnostic bare, gated by k3patch, or gated by the older
anchor script."""

from __future__ import annotations

import textwrap
from typing import NamedTuple

from k3patch.fingerprints import Shape
from k3patch.shapes import VersionRange
from k3patch.verdicts import Verdict

from .syncs import ENV

OPS_FILE = "model_executor/layers/mamba/ops/gather_initial_states.py"
OPS_MODULE = "vllm.model_executor.layers.mamba.ops.gather_initial_states"
PREFILL_FILE = "models/kimi_k3/amd/ops/kda_prefill.py"
KDA_FILE = "models/kimi_k3/amd/kda.py"


class Site(NamedTuple):
    """Where the diagnostic may be, and the details of its not-applicable results."""

    name: str
    file: str
    absent: str
    clean: str


SITES = (
    Site(
        "gather_initial_states",
        OPS_FILE,
        "gather_initial_states is absent (upstream has it from 0.27.1): nothing to gate",
        "no clamp or diagnostic: upstream gather_initial_states masks on device, no sync",
    ),
    Site(
        "chunk_kda_prefill",
        PREFILL_FILE,
        "kda_prefill.py or chunk_kda_prefill is absent here: no inlined diagnostic to gate",
        "no inlined diagnostic: it calls gather_initial_states as upstream does",
    ),
    Site(
        "KimiK3DeltaAttention._forward",
        KDA_FILE,
        "the Kimi-K3 ROCm KDA layer is absent here: no inlined diagnostic to gate",
        "no inlined diagnostic in the KDA layer",
    ),
)

# SITES.md section 3's shapes: the index, the pool size and the message are holes; all else must
# match. The fork's file is 0.27.1/0.28.0's plus the guard.
FORK_BUILDS = VersionRange("0.27.1", "0.28.0")

DIAGNOSTIC = """
if bool((HOLE_indices >= HOLE_bound).any()) or bool((HOLE_indices < 0).any()):
    import logging as _lg

    _bad = HOLE_indices[(HOLE_indices >= HOLE_bound) | (HOLE_indices < 0)]
    _lg.getLogger(__name__).warning(
        HOLE_message, int(_bad.numel()), HOLE_bound, _bad[:8].tolist()
    )
"""
GATE = f'os.environ.get("{ENV}", "0") == "1"'
GATE_COMMENT = (
    "# k3patch kda-gather-diagnostic: each bool() below waits for the GPU stream to drain, once\n"
    f"# per KDA layer per prefill chunk; the diagnostic runs only with {ENV}=1."
)
# The older anchor script's gate; its `import os as _k3os` stands in the function or the module.
LEGACY_GATE = f"_k3os.environ.get('{ENV}', '0') == '1'"
GATED = {gate: f"if {gate}:" + textwrap.indent(DIAGNOSTIC, "    ") for gate in (GATE, LEGACY_GATE)}

FORK_DIAGNOSTIC = Shape(
    "fork diagnostic", Verdict.PENDING, DIAGNOSTIC, "two bool() syncs on every call", FORK_BUILDS
)
APPLIED_DIAGNOSTIC = Shape(
    "k3patch", Verdict.APPLIED, GATED[GATE], f"the diagnostic runs only with {ENV}=1"
)
LEGACY_DIAGNOSTIC = Shape(
    "older anchor script (k3-kda-nosync)",
    Verdict.SATISFIED,
    GATED[LEGACY_GATE],
    f"legacy fix: the diagnostic runs only with {ENV}=1",
    FORK_BUILDS,
)
DIAGNOSTIC_SHAPES = (FORK_DIAGNOSTIC, APPLIED_DIAGNOSTIC, LEGACY_DIAGNOSTIC)

# The fork's guard, the diagnostic (any shape above) third; the other three statements are never
# rewritten and must be there, unchanged, for any verdict but not applicable.
_GUARD = """
_n_state_blocks = int(state.shape[0])
_safe_idx = torch.where(
    has_initial_state,
    indices.to(torch.int64).CLAMP(0, _n_state_blocks - 1),
    torch.zeros_like(indices, dtype=torch.int64),
)
HOLE_diagnostic
indices = _safe_idx
"""
GUARD_FOLDED, GUARD_SCRIPT = (
    Shape(f"fork, {how} ({c})", Verdict.PENDING, _GUARD.replace("CLAMP", c), "", FORK_BUILDS)
    for how, c in (("folded guard", "clamp_"), ("guard script", "clamp"))
)
GUARD_SHAPES = (GUARD_FOLDED, GUARD_SCRIPT)
GUARD_END = "indices = _safe_idx"
GUARD_NAMES = ("indices", "_n_state_blocks")  # HOLE_indices, HOLE_bound in gather_initial_states
