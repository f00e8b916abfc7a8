"""Upstream's shapes of the MoRIIO package: named predicates over moriio_connector.py and
moriio_engine.py, one verdict for all three files (SITES.md section 1, "Upstream")."""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass

from k3patch.astkit import find_class, find_def, find_function, mentioned_names
from k3patch.shapes import find_expressions, search
from k3patch.sources import SourceFile
from k3patch.verdicts import Verdict


@dataclass(frozen=True)
class UpstreamShape:
    name: str
    verdict: Verdict
    holds: Callable[[SourceFile, SourceFile], bool]  # (moriio_connector.py, moriio_engine.py)
    detail: str


def _native_033(connector: SourceFile, engine: SourceFile) -> bool:
    plan = find_def(engine.tree, "MoRIIOWriter._prepare_transfer_plan")
    wanted = "self.worker.layer_to_group[task.layer_name]"
    return plan is not None and any(find_expressions(wanted, plan))


def _native_031(connector: SourceFile, engine: SourceFile) -> bool:
    init = find_def(connector.tree, "MoRIIOConnectorWorker.__init__")
    wanted = "self.layer_to_group = dict(kv_cache_config.transfer_group_index_by_layer)"
    split = find_function(connector.tree, "_split_kv_cache_group_kinds")
    return split is not None and init is not None and bool(search(wanted, init))


def _hma_sliding_window_030(connector: SourceFile, engine: SourceFile) -> bool:
    init = find_def(connector.tree, "MoRIIOConnectorScheduler.__init__")
    return init is not None and "_is_hma_required" in mentioned_names(init, everything=True)


def _single_group(connector: SourceFile, engine: SourceFile) -> bool:
    cls = find_class(connector.tree, "MoRIIOConnector")
    if cls is None or "SupportsHMA" in {ast.unparse(b).split(".")[-1] for b in cls.bases}:
        return False
    return any(find_expressions("blocks.get_block_ids()[0]", connector.tree))


# Positive upstream shapes, tried before the fork's: none of them can hold on a fork tree.
NATIVE_SHAPES = (
    UpstreamShape(
        "upstream 0.33.0+ native per-group WRITE routing",
        Verdict.SATISFIED,
        _native_033,
        "MoRIIOWriter._prepare_transfer_plan takes `group = self.worker.layer_to_group"
        "[task.layer_name]` and indexes `task.local_block_ids[group]` / "
        "`request_info.block_ids[group]`; groups are split by spec, not position",
    ),
    UpstreamShape(
        "upstream 0.31.0-0.32.0 native per-group routing",
        Verdict.SATISFIED,
        _native_031,
        "groups are classified by spec (`_split_kv_cache_group_kinds`) and the worker maps "
        "`layer_to_group = dict(kv_cache_config.transfer_group_index_by_layer)`; READ mode "
        "routes per group, WRITE with a Mamba group is refused by register_kv_caches, never "
        "misrouted",
    ),
    UpstreamShape(
        "upstream 0.30.0 sliding-window-only HMA",
        Verdict.NOT_APPLICABLE,
        _hma_sliding_window_030,
        "MoRIIO supports hybrid KV caches for sliding-window models only (READ mode); a Mamba "
        "group is refused at scheduler init, so Kimi-K3 cannot use MoRIIO on this version",
    ),
)
# The single-group connector holds on the fork too (its READ path keeps `get_block_ids()[0]`),
# so it is tried only when no fork statement is there.
SINGLE_GROUP_SHAPE = UpstreamShape(
    "upstream 0.14.1-0.29.0 single-group connector",
    Verdict.NOT_APPLICABLE,
    _single_group,
    "no hybrid support: MoRIIOConnector does not implement SupportsHMA, so vLLM runs it "
    "with exactly one KV-cache group (the scheduler asserts it) and it reads block ids "
    "[0] only; Kimi-K3 (four groups) cannot use MoRIIO on this version",
)
