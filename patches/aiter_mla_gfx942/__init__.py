"""aiter-mla-gfx942: AITER MLA is off on gfx942 (MI300X) unless the user explicitly asks for it.

Symptom: Kimi-K3 serves on MI300X only while every launcher remembers `VLLM_ROCM_USE_AITER_MLA=0`;
one that forgets it dies at the first decode with an assertion inside the AITER MLA decode kernel.
Cause: that kernel (for K3's small head counts) is gfx950-only, and `rocm_aiter_ops.is_mla_enabled`,
the switch every consumer of AITER MLA reads at call time, says yes on any gfx9 when the two
AITER flags are on, as they are by default.
Fix: `is_mla_enabled` also requires a GPU other than gfx942, unless `VLLM_ROCM_USE_AITER_MLA` is
set explicitly (then the user's choice stands).
Check: `k3patch verify` runs the truth table against the patched module. 0.14.1 reads drifted:
it lacks what the fixed method calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import k3patch.astkit as astkit
from k3patch.fingerprints import Shape, match_shapes
from k3patch.patch import Patch, ProbeOutcome
from k3patch.shapes import VersionRange
from k3patch.sources import Sources
from k3patch.verdicts import SiteResult, Verdict

if TYPE_CHECKING:
    from k3patch.codemod import Codemods

FILE = "_aiter_ops.py"
ROCM_FILE = "platforms/rocm.py"
SITE = "rocm_aiter_ops.is_mla_enabled"

# The same statements in every release read so far (0.12.0-0.13.0 add a docstring, which the
# fingerprint ignores); the shape's name says which, from the range itself.
UPSTREAM_SEEN = VersionRange("0.12.0", "0.34.0")
UPSTREAM_BUGGY = Shape(
    f"upstream ({UPSTREAM_SEEN})",
    Verdict.PENDING,
    """
    @classmethod
    @if_aiter_supported
    def is_mla_enabled(cls) -> bool:
        return cls._AITER_ENABLED and cls._MLA_ENABLED
    """,
    origin="both AITER flags only; gfx942 is not excluded",
    versions=UPSTREAM_SEEN,
)

POST_IMAGE = """
@classmethod
@if_aiter_supported
def is_mla_enabled(cls) -> bool:
    # k3patch aiter-mla-gfx942: the AITER MLA decode kernel that Kimi-K3 needs is gfx950-only
    # and asserts on gfx942 (MI300X). Off there unless VLLM_ROCM_USE_AITER_MLA is set explicitly.
    if not (cls._AITER_ENABLED and cls._MLA_ENABLED):
        return False
    if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):
        return True
    # Imported here: vllm.platforms.rocm cannot be imported on a machine without a GPU.
    from vllm.platforms.rocm import on_gfx942

    return not on_gfx942()
"""

APPLIED = Shape("k3patch", Verdict.APPLIED, POST_IMAGE, origin="gfx942 excluded unless explicit")
SHAPES = (UPSTREAM_BUGGY, APPLIED)


class AiterMlaGfx942(Patch):
    id = "aiter-mla-gfx942"
    title = "AITER MLA off on gfx942 unless VLLM_ROCM_USE_AITER_MLA is set explicitly"
    files = (FILE, ROCM_FILE)
    modules = ("vllm._aiter_ops",)
    caveat = (
        "an explicit --attention-backend ROCM_AITER_MLA bypasses is_mla_enabled and is not covered"
    )

    def classify(self, sources: Sources) -> list[SiteResult]:
        src = sources[FILE]
        if not src.exists or (method := astkit.find_def(src.tree, SITE)) is None:
            why = (
                f"{SITE} is absent: no AITER MLA switch" if src.exists else f"vllm/{FILE} is absent"
            )
            return [self.result(SITE, FILE, Verdict.NOT_APPLICABLE, why)]
        result = match_shapes(self.id, SITE, src, method, SHAPES)
        if result.verdict is not Verdict.PENDING:
            return [result]
        # The post-image calls `envs.is_set` and imports `on_gfx942`; both exist from 0.15.0 on.
        missing, rocm = [], sources[ROCM_FILE]
        if not astkit.module_binds(src.tree, "envs"):
            missing.append("`import vllm.envs as envs` in _aiter_ops.py")
        if not rocm.exists or astkit.find_function(rocm.tree, "on_gfx942") is None:
            missing.append("`on_gfx942()` in vllm/platforms/rocm.py (vLLM 0.15.0 or later)")
        if missing:
            detail = "known buggy shape, but the fix needs " + "; ".join(missing)
            found, line, shape = src.segment(method), result.line, result.shape
            return [SiteResult.drift(self.id, SITE, FILE, detail, line, found, missing, shape)]
        return [result]

    def rewrite(self, sources: Sources, pending: list[SiteResult], files: Codemods) -> None:
        from .rewrite import ExcludeGfx942  # libcst: only when there is something to rewrite

        codemod = files[FILE]
        codemod.transform(ExcludeGfx942(SITE, POST_IMAGE, codemod.newline))

    def probe(self) -> ProbeOutcome:
        from .probe import probe_truth_table

        return probe_truth_table()


PATCH = AiterMlaGfx942()
