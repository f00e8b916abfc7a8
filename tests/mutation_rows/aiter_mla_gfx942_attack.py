# ruff: noqa: E501  (rows hold the edits verbatim, one string per line of the tree)
"""aiter_mla_gfx942's attack rows (issue 28; see attack_common.py). Every one is a TREE_ROW: status reads
each edit of the post-image, and each hand port onto an unpatched tree (the correct control
included), drifted, so no probe runs. No harness VARIANTS: the declaration is a codemod there,
and the distinct ideas duplicate rows already in aiter_mla_gfx942.py (see benchmarks/ATTACK-28.md).
"""

from __future__ import annotations

from .attack_common import TreeRow
from .common import Variant

VARIANTS: tuple[Variant, ...] = ()

TREE_ROWS: tuple[TreeRow, ...] = (
    TreeRow(
        id="aiter-wrong-var",
        patch="aiter-mla-gfx942",
        what="checks the general AITER flag for 'explicit': every launcher sets VLLM_ROCM_USE_AITER=1, so gfx942 gets AITER MLA and asserts at the first decode",
        tree="0.31.0",
        base="applied",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                '        if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n',
                '        if envs.is_set("VLLM_ROCM_USE_AITER"):\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="aiter-wrong-var",
        patch="aiter-mla-gfx942",
        what="checks the general AITER flag for 'explicit': every launcher sets VLLM_ROCM_USE_AITER=1, so gfx942 gets AITER MLA and asserts at the first decode",
        tree="fork-a",
        base="applied",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                '        if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n',
                '        if envs.is_set("VLLM_ROCM_USE_AITER"):\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="aiter-gfx950-only",
        patch="aiter-mla-gfx942",
        what="'the kernel is gfx950-only' so require gfx950: AITER MLA off on every other arch too",
        tree="0.31.0",
        base="applied",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                "        from vllm.platforms.rocm import on_gfx942\n\n        return not on_gfx942()\n",
                "        from vllm.platforms.rocm import on_gfx950\n\n        return on_gfx950()\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="aiter-gfx950-only",
        patch="aiter-mla-gfx942",
        what="'the kernel is gfx950-only' so require gfx950: AITER MLA off on every other arch too",
        tree="fork-a",
        base="applied",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                "        from vllm.platforms.rocm import on_gfx942\n\n        return not on_gfx942()\n",
                "        from vllm.platforms.rocm import on_gfx950\n\n        return on_gfx950()\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="aiter-case-sensitive",
        patch="aiter-mla-gfx942",
        what="explicit means the value '1' or 'true', case-sensitively: =True or =TRUE on gfx942 is overridden though vLLM's own parse accepts it",
        tree="0.31.0",
        base="applied",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                '        if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n',
                '        if os.environ.get("VLLM_ROCM_USE_AITER_MLA") in ("1", "true"):\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="aiter-case-sensitive",
        patch="aiter-mla-gfx942",
        what="explicit means the value '1' or 'true', case-sensitively: =True or =TRUE on gfx942 is overridden though vLLM's own parse accepts it",
        tree="fork-a",
        base="applied",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                '        if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n',
                '        if os.environ.get("VLLM_ROCM_USE_AITER_MLA") in ("1", "true"):\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="aiter-cached",
        patch="aiter-mla-gfx942",
        what="memoised: the first answer sticks; refresh_env_variables() and a later env change are ignored",
        tree="0.31.0",
        base="applied",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                "    @if_aiter_supported\n    def is_mla_enabled(cls) -> bool:\n",
                "    @if_aiter_supported\n    @functools.cache\n    def is_mla_enabled(cls) -> bool:\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="aiter-cached",
        patch="aiter-mla-gfx942",
        what="memoised: the first answer sticks; refresh_env_variables() and a later env change are ignored",
        tree="fork-a",
        base="applied",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                "    @if_aiter_supported\n    def is_mla_enabled(cls) -> bool:\n",
                "    @if_aiter_supported\n    @functools.cache\n    def is_mla_enabled(cls) -> bool:\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="aiter-truthy-value",
        patch="aiter-mla-gfx942",
        what="CONTROL: 'set' judged by a non-empty value; an empty value already makes _MLA_ENABLED false, so this should behave the same",
        tree="0.31.0",
        base="applied",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                '        if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n',
                '        if os.environ.get("VLLM_ROCM_USE_AITER_MLA"):\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="aiter-truthy-value",
        patch="aiter-mla-gfx942",
        what="CONTROL: 'set' judged by a non-empty value; an empty value already makes _MLA_ENABLED false, so this should behave the same",
        tree="fork-a",
        base="applied",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                '        if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n',
                '        if os.environ.get("VLLM_ROCM_USE_AITER_MLA"):\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="a-hp-correct",
        patch="aiter-mla-gfx942",
        what="CONTROL: a correct hand port",
        tree="0.31.0",
        base="pristine",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                "    def is_mla_enabled(cls) -> bool:\n        return cls._AITER_ENABLED and cls._MLA_ENABLED\n",
                '    def is_mla_enabled(cls) -> bool:\n        if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n            return cls._AITER_ENABLED and cls._MLA_ENABLED\n        from vllm.platforms.rocm import on_gfx942\n\n        return cls._AITER_ENABLED and cls._MLA_ENABLED and not on_gfx942()\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="a-hp-wrong-var",
        patch="aiter-mla-gfx942",
        what="explicit judged by the general AITER flag, which every launcher sets",
        tree="0.31.0",
        base="pristine",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                "    def is_mla_enabled(cls) -> bool:\n        return cls._AITER_ENABLED and cls._MLA_ENABLED\n",
                '    def is_mla_enabled(cls) -> bool:\n        if envs.is_set("VLLM_ROCM_USE_AITER"):\n            return cls._AITER_ENABLED and cls._MLA_ENABLED\n        from vllm.platforms.rocm import on_gfx942\n\n        return cls._AITER_ENABLED and cls._MLA_ENABLED and not on_gfx942()\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="a-hp-gfx950",
        patch="aiter-mla-gfx942",
        what="'gfx950-only kernel' so require gfx950",
        tree="0.31.0",
        base="pristine",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                "    def is_mla_enabled(cls) -> bool:\n        return cls._AITER_ENABLED and cls._MLA_ENABLED\n",
                '    def is_mla_enabled(cls) -> bool:\n        if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):\n            return cls._AITER_ENABLED and cls._MLA_ENABLED\n        from vllm.platforms.rocm import on_gfx950\n\n        return cls._AITER_ENABLED and cls._MLA_ENABLED and on_gfx950()\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="a-hp-case",
        patch="aiter-mla-gfx942",
        what="explicit means '1' or 'true', case-sensitively",
        tree="0.31.0",
        base="pristine",
        file="vllm/_aiter_ops.py",
        edits=(
            (
                "    def is_mla_enabled(cls) -> bool:\n        return cls._AITER_ENABLED and cls._MLA_ENABLED\n",
                '    def is_mla_enabled(cls) -> bool:\n        if os.environ.get("VLLM_ROCM_USE_AITER_MLA") in ("1", "true"):\n            return cls._AITER_ENABLED and cls._MLA_ENABLED\n        from vllm.platforms.rocm import on_gfx942\n\n        return cls._AITER_ENABLED and cls._MLA_ENABLED and not on_gfx942()\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
)
