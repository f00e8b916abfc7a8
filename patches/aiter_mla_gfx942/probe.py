"""aiter-mla-gfx942's probe, in the verify child on the real module: no GPU needed, it stands in
`vllm.platforms.rocm` with a module whose `on_gfx942` it controls."""

from __future__ import annotations

from k3patch.model import ProbeOutcome
from k3patch.probekit import Checks, Swap

# (env value or None for unset, on gfx942, AITER flag, MLA flag) -> expected is_mla_enabled
TRUTH_TABLE: tuple[tuple[str | None, bool, bool, bool, bool], ...] = (
    (None, True, True, True, False),
    ("1", True, True, True, True),
    ("0", True, True, False, False),
    ("0", False, True, False, False),
    (None, False, True, True, True),
    (None, False, False, True, False),
    (None, False, True, False, False),
    ("1", True, False, True, False),
)


def probe_truth_table() -> ProbeOutcome:
    from vllm._aiter_ops import rocm_aiter_ops  # type: ignore[import-not-found]

    # `if_aiter_supported` returns None off ROCm; the probe calls the function it wraps.
    raw = rocm_aiter_ops.__dict__["is_mla_enabled"].__func__
    func = getattr(raw, "__wrapped__", raw)
    checks = Checks("truth table")
    with Swap() as swap:
        fake_rocm = swap.module("vllm.platforms.rocm")
        for env, gfx942, aiter, mla, expected in TRUTH_TABLE:
            fake_rocm.on_gfx942 = lambda gfx942=gfx942: gfx942  # type: ignore[attr-defined]
            swap.env("VLLM_ROCM_USE_AITER_MLA", env)
            swap.attr(rocm_aiter_ops, "_AITER_ENABLED", aiter)
            swap.attr(rocm_aiter_ops, "_MLA_ENABLED", mla)
            gpu = "gfx942" if gfx942 else "gfx950"
            case = f"VLLM_ROCM_USE_AITER_MLA={env or 'unset'} {gpu} aiter={aiter:d} mla={mla:d}"
            checks.expect(case, got=bool(func(rocm_aiter_ops)), want=expected)
    return checks.outcome()
