"""The trees the tests build, each as the recipe's older scripts leave vLLM 0.28.0.

The recipe runs, in this order: block_size_fix, page_pad, port_offset_tpsize, pod_hosts,
mamba_blockids, remote_tp_fix, mamba_n1, group_routing, [chunked_allgrp, chunk_gate_fix only
with K3_EXTRA_FIXES=1], xfer_probe, write_fence, mamba_diag, save_skip_mamba, kda_gather_guard.
kda_gather_nosync is not in that list; the fork's folded image carries its effect.
"""

from __future__ import annotations

from . import chunk_gate, kda, moriio, tree  # noqa: F401  (they register their steps)

# Scripts that run before mamba_blockids and edit the MoRIIO files around k3patch's sites.
_PRE = ("block_size_fix", "page_pad", "port_offset_tpsize", "pod_hosts")
# Scripts that run after group_routing (and the extra fixes) in the recipe.
_POST = ("xfer_probe", "write_fence", "mamba_diag", "save_skip_mamba")


def _recipe(
    mamba: str = "mamba_blockids",
    group_routing: bool = False,
    extra: bool = False,
    kda_steps: tuple[str, ...] = ("kda_gather_guard",),
) -> tuple[str, ...]:
    steps = [*_PRE, mamba, "remote_tp_fix", "mamba_n1"]
    if group_routing:
        steps.append("group_routing")
    if extra:
        steps += ["chunked_allgrp", "chunk_gate_fix"]
    steps += [*_POST, *kda_steps]
    return tuple(steps)


tree("a", _recipe(), "fork pre-image (mamba block ids) + the KDA guard script")
tree(
    "b",
    _recipe(kda_steps=("kda_fork_folded",)),
    "as (a), with the fork's own gather_initial_states.py shape (clamp_, folded)",
)
# group_routing's plan anchor holds four comment lines under `if _k3_mamba:` that the stored
# mamba-blockids script does not write; after that script it (two-pass) writes nothing. The
# trees that carry it therefore build on the mamba-blockids version with those lines.
_GR = "mamba_blockids_comments"
tree(
    "c",
    _recipe(mamba=_GR, group_routing=True),
    "(a-comments) + the older group-routing fix alone (K3_EXTRA_FIXES=0)",
)
tree(
    "d",
    _recipe(
        mamba=_GR,
        group_routing=True,
        extra=True,
        kda_steps=("kda_gather_guard", "kda_gather_nosync"),
    ),
    "(c) + its chunked companion + the older chunk-gate fix + the KDA no-sync fix",
)
# Plan-site variants of the mamba-blockids pre-image.
tree(
    "a-comments",
    _recipe(mamba="mamba_blockids_comments"),
    "(a) with the four comment lines under `if _k3_mamba:`",
)
tree(
    "a-nodebug",
    _recipe(mamba="mamba_blockids_nodebug"),
    "(a) without the K3_MAMBA_BC debug block",
)
