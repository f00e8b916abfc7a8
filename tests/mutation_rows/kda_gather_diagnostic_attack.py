# ruff: noqa: E501  (rows hold the edits verbatim, one string per line of the tree)
"""kda_gather_diagnostic's attack rows (issue 28; see attack_common.py). Every one is a TREE_ROW: status reads
each edit of the post-image, and each hand port onto an unpatched tree (the correct control
included), drifted, so no probe runs. No harness VARIANTS: the declaration is a codemod there,
and the distinct ideas duplicate rows already in kda_gather_diagnostic.py (see benchmarks/ATTACK-28.md).
"""

from __future__ import annotations

from .attack_common import TreeRow
from .common import Variant

VARIANTS: tuple[Variant, ...] = ()

TREE_ROWS: tuple[TreeRow, ...] = (
    TreeRow(
        id="kda-clamp-upper-n",
        patch="kda-gather-diagnostic",
        what="clamp upper bound off by one: index n (one past the pool) reaches the kernel",
        tree="fork-a",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "        indices.to(torch.int64).clamp(0, _n_state_blocks - 1),\n",
                "        indices.to(torch.int64).clamp(0, _n_state_blocks),\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kda-env-any-value",
        patch="kda-gather-diagnostic",
        what="any value enables the diagnostic: an operator's explicit K3_KDA_GATHER_LOG=0 syncs",
        tree="fork-a",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                '    if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":\n',
                '    if os.environ.get("K3_KDA_GATHER_LOG"):\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kda-env-any-value",
        patch="kda-gather-diagnostic",
        what="any value enables the diagnostic: an operator's explicit K3_KDA_GATHER_LOG=0 syncs",
        tree="fork-b",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                '    if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":\n',
                '    if os.environ.get("K3_KDA_GATHER_LOG"):\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kda-clamp-inside-gate",
        patch="kda-gather-diagnostic",
        what="one indent too many: the clamped indices are used only when the diagnostic runs; by default the raw out-of-range indices reach the kernel",
        tree="fork-a",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "            )\n    indices = _safe_idx\n",
                "            )\n        indices = _safe_idx\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kda-clamp-inside-gate",
        patch="kda-gather-diagnostic",
        what="one indent too many: the clamped indices are used only when the diagnostic runs; by default the raw out-of-range indices reach the kernel",
        tree="fork-b",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "            )\n    indices = _safe_idx\n",
                "            )\n        indices = _safe_idx\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kda-gate-log-only",
        patch="kda-gather-diagnostic",
        what="gates the warning, not the check: both bool() syncs still run on every call",
        tree="fork-a",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                '    if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":\n        if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n',
                '    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n        if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kda-gate-log-only",
        patch="kda-gather-diagnostic",
        what="gates the warning, not the check: both bool() syncs still run on every call",
        tree="fork-b",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                '    if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":\n        if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n',
                '    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n        if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kda-env-at-import",
        patch="kda-gather-diagnostic",
        what="reads the switch once at import (a constant): same for an operator who sets it before launch; a switch set later is ignored",
        tree="fork-a",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "import os\n\n\n@triton.jit\n",
                'import os\n\n_K3_KDA_GATHER_LOG = os.environ.get("K3_KDA_GATHER_LOG", "0") == "1"\n\n\n@triton.jit\n',
            ),
            (
                '    if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":\n',
                "    if _K3_KDA_GATHER_LOG:\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="k-hp-correct",
        patch="kda-gather-diagnostic",
        what="CONTROL: a correct hand port",
        tree="fork-a",
        base="pristine",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n",
                "        )\n",
                '    if os.environ.get("K3_KDA_GATHER_LOG") == "1":\n        if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n            import logging as _lg\n            _bad = indices[(indices >= _n_state_blocks) | (indices < 0)]\n            _lg.getLogger(__name__).warning(\n                "[k3-kda gather] clamped %d out-of-range state idx (n_blocks=%d, "\n                "sample=%s); disagg producer prefill likely mis-flagged initial state.",\n                int(_bad.numel()), _n_state_blocks, _bad[:8].tolist(),\n            )\n',
            ),
            ("import torch\n", "import os\n\nimport torch\n"),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="k-hp-any-value",
        patch="kda-gather-diagnostic",
        what="any value (also '0') enables the syncing diagnostic",
        tree="fork-a",
        base="pristine",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n",
                "        )\n",
                '    if os.environ.get("K3_KDA_GATHER_LOG"):\n        if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n            import logging as _lg\n            _bad = indices[(indices >= _n_state_blocks) | (indices < 0)]\n            _lg.getLogger(__name__).warning(\n                "[k3-kda gather] clamped %d out-of-range state idx (n_blocks=%d, "\n                "sample=%s); disagg producer prefill likely mis-flagged initial state.",\n                int(_bad.numel()), _n_state_blocks, _bad[:8].tolist(),\n            )\n',
            ),
            ("import torch\n", "import os\n\nimport torch\n"),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="k-hp-log-only",
        patch="kda-gather-diagnostic",
        what="gates the warning, not the bool() checks: the syncs stay",
        tree="fork-a",
        base="pristine",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n",
                "        )\n",
                '    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n        if os.environ.get("K3_KDA_GATHER_LOG") == "1":\n            import logging as _lg\n            _bad = indices[(indices >= _n_state_blocks) | (indices < 0)]\n            _lg.getLogger(__name__).warning(\n                "[k3-kda gather] clamped %d out-of-range state idx (n_blocks=%d, "\n                "sample=%s); disagg producer prefill likely mis-flagged initial state.",\n                int(_bad.numel()), _n_state_blocks, _bad[:8].tolist(),\n            )\n',
            ),
            ("import torch\n", "import os\n\nimport torch\n"),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="k-hp-upper-n",
        patch="kda-gather-diagnostic",
        what="the gate right, the clamp's upper bound off by one while there",
        tree="fork-a",
        base="pristine",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n",
                "        )\n",
                '    if os.environ.get("K3_KDA_GATHER_LOG") == "1":\n        if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n            import logging as _lg\n            _bad = indices[(indices >= _n_state_blocks) | (indices < 0)]\n            _lg.getLogger(__name__).warning(\n                "[k3-kda gather] clamped %d out-of-range state idx (n_blocks=%d, "\n                "sample=%s); disagg producer prefill likely mis-flagged initial state.",\n                int(_bad.numel()), _n_state_blocks, _bad[:8].tolist(),\n            )\n',
            ),
            ("import torch\n", "import os\n\nimport torch\n"),
            (
                "        indices.to(torch.int64).clamp(0, _n_state_blocks - 1),\n",
                "        indices.to(torch.int64).clamp(0, _n_state_blocks),\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kd-legacy-upper-n",
        patch="kda-gather-diagnostic",
        what="legacy form with the clamp's upper bound off by one",
        tree="fork-d",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "        indices.to(torch.int64).clamp(0, _n_state_blocks - 1),\n",
                "        indices.to(torch.int64).clamp(0, _n_state_blocks),\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kd-legacy-any-value",
        patch="kda-gather-diagnostic",
        what="legacy form where any value (also 0) enables the syncing diagnostic",
        tree="fork-d",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "    if _k3os.environ.get('K3_KDA_GATHER_LOG', '0') == '1':\n",
                "    if _k3os.environ.get('K3_KDA_GATHER_LOG'):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kd-legacy-clamp-in-gate",
        patch="kda-gather-diagnostic",
        what="legacy form with the clamped indices used only under the diagnostic",
        tree="fork-d",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "            )\n    indices = _safe_idx\n",
                "            )\n        indices = _safe_idx\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="kd-legacy-log-only",
        patch="kda-gather-diagnostic",
        what="legacy form gating the warning, not the syncing check",
        tree="fork-d",
        base="applied",
        file="vllm/model_executor/layers/mamba/ops/gather_initial_states.py",
        edits=(
            (
                "    if _k3os.environ.get('K3_KDA_GATHER_LOG', '0') == '1':\n        if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n",
                "    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n        if _k3os.environ.get('K3_KDA_GATHER_LOG', '0') == '1':\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
)
