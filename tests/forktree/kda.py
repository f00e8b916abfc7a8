"""The KDA `gather_initial_states` edits, over vLLM 0.28.0's
`model_executor/layers/mamba/ops/gather_initial_states.py`.

- kda_gather_guard: apply_kimik3_kda_gather_guard.py, its one hunk (after
  `assert state[0].is_contiguous()`): `_n_state_blocks`, the clamped `_safe_idx` (`.clamp`), the
  diagnostic `if bool(...any()) or bool(...any()):` with its warning, `indices = _safe_idx`.
- kda_fork_folded: the fork's own folded file (SITES.md section 3, "The fork's file"): the same
  statements with the in-place `.clamp_`, under a shorter comment that starts `# k3-kda guard:`.
- kda_gather_nosync: apply_kimik3_kda_gather_nosync.py, its one hunk (OLD -> NEW): the diagnostic
  nested under `if _k3os.environ.get('K3_KDA_GATHER_LOG', '0') == '1':` after `import os as _k3os`.

The statements are reproduced verbatim (k3patch matches them); the comments are ours.
"""

from __future__ import annotations

from . import Hunk, step

FILE = "model_executor/layers/mamba/ops/gather_initial_states.py"
GUARD = "apply_kimik3_kda_gather_guard.py"
NOSYNC = "apply_kimik3_kda_gather_nosync.py"

# The anchor both guard forms are inserted at (0.28.0's text).
_ANCHOR = (
    "    row_size = state[0].numel()\n"
    "    # Mamba pages may pad stride(0), but each state row remains dense.\n"
    "    assert state[0].is_contiguous()\n"
    "    output = torch.empty(\n"
)

_DIAGNOSTIC = (
    "    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n"
    "        import logging as _lg\n"
    "        _bad = indices[(indices >= _n_state_blocks) | (indices < 0)]\n"
    "        _lg.getLogger(__name__).warning(\n"
    '            "[k3-kda gather] clamped %d out-of-range state idx (n_blocks=%d, "\n'
    '            "sample=%s); disagg producer prefill likely mis-flagged initial state.",\n'
    "            int(_bad.numel()), _n_state_blocks, _bad[:8].tolist(),\n"
    "        )\n"
)


def _guard(clamp: str, comment: str) -> str:
    return (
        "    row_size = state[0].numel()\n"
        "    # Mamba pages may pad stride(0), but each state row remains dense.\n"
        "    assert state[0].is_contiguous()\n"
        f"{comment}"
        "    _n_state_blocks = int(state.shape[0])\n"
        "    _safe_idx = torch.where(\n"
        "        has_initial_state,\n"
        f"        indices.to(torch.int64).{clamp}(0, _n_state_blocks - 1),\n"
        "        torch.zeros_like(indices, dtype=torch.int64),\n"
        "    )\n"
        f"{_DIAGNOSTIC}"
        "    indices = _safe_idx\n"
        "    output = torch.empty(\n"
    )


step(
    "kda_gather_guard",
    [
        Hunk(
            GUARD,
            "main(), the one anchor -> repl",
            FILE,
            _ANCHOR,
            _guard(
                "clamp",
                "    # k3-kda guard (as the guard script leaves it): an index past the state pool\n"
                "    # would make the kernel form an address outside it even where the load is\n"
                "    # masked, which faults the GPU. Indices without an initial state become 0\n"
                "    # and the rest are clamped into range, on device. Seen on the disagg\n"
                "    # producer's prefill. The warning below reports what was clamped, and\n"
                "    # each bool() in it waits for the GPU.\n",
            ),
        )
    ],
)

step(
    "kda_fork_folded",
    [
        Hunk(
            "the fork's folded gather_initial_states.py (no script: the image carries it)",
            "the guard as folded into the fork's file",
            FILE,
            _ANCHOR,
            _guard(
                "clamp_",
                "    # k3-kda guard: keep every state index inside the pool, on device, and\n"
                "    # say which ones were not.\n",
            ),
        )
    ],
)

step(
    "kda_gather_nosync",
    [
        Hunk(
            NOSYNC,
            "main(), OLD -> NEW",
            FILE,
            _DIAGNOSTIC,
            "    import os as _k3os  # k3-kda-nosync: the clamp above needs no sync; the\n"
            "    # diagnostic below waits for the GPU twice per call, so it runs only on request.\n"
            "    if _k3os.environ.get('K3_KDA_GATHER_LOG', '0') == '1':\n"
            + "".join("    " + line + "\n" for line in _DIAGNOSTIC.splitlines()),
        )
    ],
)
