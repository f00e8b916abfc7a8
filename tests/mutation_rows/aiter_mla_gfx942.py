"""aiter-mla-gfx942's wrong fixes: POST_IMAGE is both what apply writes and the applied shape."""

from __future__ import annotations

from .common import AITER, AITER_DECL, FIRST, ISSUE_28, Sub, Variant

TREES = ("0.31.0", "fork-a")
EXPLICIT = 'if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):'
ARCH = "    from vllm.platforms.rocm import on_gfx942\n\n    return not on_gfx942()"


def _aiter(
    id: str, what: str, old: str, new: str, equivalent: str = "", written: str = FIRST
) -> Variant:
    return Variant(id, AITER, what, (Sub(AITER_DECL, old, new),), TREES, equivalent, written)


VARIANTS: tuple[Variant, ...] = (
    _aiter(
        "aiter-no-explicit",
        "the `envs.is_set` branch dropped: an explicit VLLM_ROCM_USE_AITER_MLA=1 on gfx942 is off",
        '    if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n        return True\n',
        "",
    ),
    _aiter(
        "aiter-gfx942-inverted",
        "`return not on_gfx942()` -> `return on_gfx942()`",
        "    return not on_gfx942()",
        "    return on_gfx942()",
    ),
    _aiter(
        "aiter-flags-or",
        "`_AITER_ENABLED and _MLA_ENABLED` -> `or`",
        "if not (cls._AITER_ENABLED and cls._MLA_ENABLED):",
        "if not (cls._AITER_ENABLED or cls._MLA_ENABLED):",
    ),
    _aiter(
        "aiter-no-mla-flag",
        "the MLA flag dropped from the first test (AITER flag alone)",
        "if not (cls._AITER_ENABLED and cls._MLA_ENABLED):",
        "if not cls._AITER_ENABLED:",
    ),
    _aiter(
        "aiter-explicit-first",
        "the explicit-variable branch before the flags: =1 turns MLA on with AITER off",
        "    if not (cls._AITER_ENABLED and cls._MLA_ENABLED):\n        return False\n"
        '    if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n        return True\n',
        '    if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n        return True\n'
        "    if not (cls._AITER_ENABLED and cls._MLA_ENABLED):\n        return False\n",
    ),
    _aiter(
        "aiter-explicit-inverted",
        "`if envs.is_set(...)` -> `if not envs.is_set(...)`",
        EXPLICIT,
        'if not envs.is_set("VLLM_ROCM_USE_AITER_MLA"):',
    ),
    _aiter(
        "aiter-value-not-set",
        "`envs.is_set(VAR)` -> the variable's value (`envs.VLLM_ROCM_USE_AITER_MLA`, default True)",
        EXPLICIT,
        "if envs.VLLM_ROCM_USE_AITER_MLA:",
    ),
    # ---- issue 28: written before its probes were extended.
    _aiter(
        "aiter-explicit-only-1",
        "\"set explicitly\" read as `os.environ.get(VAR) == '1'`: an explicit "
        "VLLM_ROCM_USE_AITER_MLA=True (which vLLM reads as on) is overridden on gfx942",
        EXPLICIT,
        'if os.environ.get("VLLM_ROCM_USE_AITER_MLA") == "1":',
        written=ISSUE_28,
    ),
    _aiter(
        "aiter-explicit-lowercase",
        "\"set explicitly\" judged by the spellings `('1', 'true')`, case-sensitive: =True and "
        "=TRUE (vLLM lower-cases them: on) are overridden on gfx942",
        EXPLICIT,
        'if os.environ.get("VLLM_ROCM_USE_AITER_MLA", "") in ("1", "true"):',
        written=ISSUE_28,
    ),
    _aiter(
        "aiter-explicit-other-variable",
        "the explicit test reads VLLM_ROCM_USE_AITER (the general switch every ROCm launcher "
        "sets): MLA stays on on gfx942 although nobody asked for it",
        EXPLICIT,
        'if envs.is_set("VLLM_ROCM_USE_AITER"):',
        written=ISSUE_28,
    ),
    _aiter(
        "aiter-only-gfx950",
        "`not on_gfx942()` -> `on_gfx950()`: MLA also off on every other AITER arch (gfx90a), "
        "which the fix must leave as it was",
        ARCH,
        "    from vllm.platforms.rocm import on_gfx950\n\n    return on_gfx950()",
        written=ISSUE_28,
    ),
    _aiter(
        "aiter-memoized",
        "`@functools.cache` on the switch (it imports in a hot path): the first answer sticks, "
        "later env and flag changes (vLLM's refresh_env_variables) are ignored",
        "@if_aiter_supported\ndef is_mla_enabled(cls) -> bool:\n    # k3patch",
        "@if_aiter_supported\n@functools.cache\ndef is_mla_enabled(cls) -> bool:\n    # k3patch",
        written=ISSUE_28,
    ),
)
