"""The mutation check (issue 19): wrong fixes that k3patch itself would write and read as applied,
each held against apply's own re-check, verify's probes on real trees, and a named test subset.

    .venv/bin/python benchmarks/mutants.py [--only VARIANT]... [--patch ID]... [--trees T,...]
                                           [--source HEAD|worktree] [--tests survivors|all|none]
                                           [--no-write] [--list]

Each VARIANT below is a few substitutions in a patch's declared post-image (the text `apply`
writes, which is also the shape `status` reads as k3patch's), each of which must occur exactly
once in today's file: a variant whose anchor moved is a table error, reported, never skipped
quietly. Per variant:
1. k3patch's `k3patch/` and `patches/` (from the last commit by default: others' uncommitted
   edits are not what is measured) are copied into a temp dir laid out as the installed package,
   and the substitutions are made there;
2. per tree (upstream wheels and the fork trees of tests/forktree, each where the patch is
   pending) a fresh full copy is made, read pending with the scratch k3patch, and applied: a
   refusal, or the patch not reading applied afterwards, is "killed by apply";
3. `k3patch verify --json` of the scratch k3patch, with the tree interpreter
   (.venv-vllm/bin/python), runs the mutated patch's probe (the two MoRIIO patches together:
   they share moriio_connector.py and chunk gate's probe drives group routing's code): a failed
   probe or a module broken by the patch is "killed by probes";
4. the patch's own test file (TESTS below; `-m "not verify" -x`, the scratch copy's tests
   against the scratch k3patch) is "killed by tests" when it fails: by default only for the
   variants that apply and the probes let through (what only tests catch; `--tests all` runs
   it for every variant, about 15-50 s each). Every tree, and every test subset that runs, is
   first run on the unmutated copy: a kill against a failing baseline is none.
A survivor stays only with a declared reason (`equivalent=`) why it behaves as the real fix.

The report (stdout, and the "Mutants" section of benchmarks/RESULTS.md unless --no-write or a
partial run) gives per variant the trees and their outcome: A killed by apply, P killed by
probes, S survived.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEV_PYTHON = ROOT / ".venv" / "bin" / "python"
TREE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

AITER, CHUNK, ROUTING, KDA = (
    "aiter-mla-gfx942",
    "moriio-chunk-gate",
    "moriio-group-routing",
    "kda-gather-diagnostic",
)
# The declaration files, relative to patches/.
AITER_DECL = "aiter_mla_gfx942/__init__.py"
CHUNK_DECL = "moriio_chunk_gate/__init__.py"
CHUNK_LEGACY = "moriio_chunk_gate/gates.py"
ROUTING_FORMS = "moriio_group_routing/forms.py"
ROUTING_DECL = "moriio_group_routing/__init__.py"
KDA_DECL = "kda_gather_diagnostic/__init__.py"

# Which probes verify runs for a patch's variants.
VERIFY_WITH = {AITER: (AITER,), KDA: (KDA,), CHUNK: (CHUNK, ROUTING), ROUTING: (CHUNK, ROUTING)}
# The test subset per patch ("killed by tests"): the patch's own file, without verify children.
TESTS = {
    AITER: ("tests/test_aiter_mla_gfx942.py",),
    CHUNK: ("tests/test_moriio_chunk_gate.py",),
    ROUTING: ("tests/test_moriio_group_routing.py",),
    KDA: ("tests/test_kda_gather_diagnostic.py",),
}
TEST_ARGS = ("-q", "-x", "-p", "no:cacheprovider", "-m", "not verify")
TEST_TIMEOUT = 240


@dataclass(frozen=True)
class Sub:
    file: str  # relative to patches/
    old: str
    new: str


@dataclass(frozen=True)
class Variant:
    id: str
    patch: str
    what: str
    subs: tuple[Sub, ...]
    trees: tuple[str, ...]
    equivalent: str = ""  # why it behaves as the real fix, if it is expected to survive


def _aiter(id: str, what: str, old: str, new: str, equivalent: str = "") -> Variant:
    return Variant(id, AITER, what, (Sub(AITER_DECL, old, new),), ("0.31.0", "fork-a"), equivalent)


def _kda(id: str, what: str, *subs: Sub) -> Variant:
    return Variant(id, KDA, what, subs, ("fork-a", "fork-b"))


def _routing(id: str, what: str, *subs: Sub, trees: tuple[str, ...] = ("fork-a",), eq: str = ""):
    return Variant(id, ROUTING, what, subs, trees, eq)


def _g1(old: str, new: str) -> tuple[Sub, ...]:
    """G1's post-image changed (k3patch's applied shape of it is the post-image, so with it)."""
    return (Sub(CHUNK_DECL, old, new),)


GATE = """GATE = f'os.environ.get("{ENV}", "0") == "1"'"""
# The rewrite's gate step, and a step after it that rewrites the guard's index without its clamp.
KDA_NEST = '                codemod.nest_under([node], f"if {GATE}:")\n'
KDA_UNCLAMP = """\
                function = astkit.find_def(sources[site.file].tree, site.name)
                safe = [s for s in function.body if astkit.bindings([s], "_safe_idx")]
                codemod.replace(
                    safe[:1],
                    "_safe_idx = torch.where(has_initial_state, indices.to(torch.int64), "
                    "torch.zeros_like(indices, dtype=torch.int64))",
                )
"""
G1_PROGRESS = """        + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        >= req.num_prompt_tokens
"""
G2_PROGRESS = """    + scheduler_output.num_scheduled_tokens.get(req_id, 0)
    < req.num_prompt_tokens
"""
CHUNK_TREES = ("0.31.0", "fork-a")  # shape D gates, shape C gates in the fork

VARIANTS: tuple[Variant, ...] = (
    # ---- aiter-mla-gfx942: POST_IMAGE is both what apply writes and the applied shape.
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
        'if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):',
        'if not envs.is_set("VLLM_ROCM_USE_AITER_MLA"):',
    ),
    _aiter(
        "aiter-value-not-set",
        "`envs.is_set(VAR)` -> the variable's value (`envs.VLLM_ROCM_USE_AITER_MLA`, default True)",
        'if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):',
        "if envs.VLLM_ROCM_USE_AITER_MLA:",
    ),
    # ---- moriio-chunk-gate: G1/G2 templates (the applied shapes are the templates themselves).
    Variant(
        "chunk-g1-gt",
        CHUNK,
        "G1 `>=` -> `>`: the save waits for progress past the prompt (never, on the final chunk)",
        _g1(
            G1_PROGRESS,
            G1_PROGRESS.replace(">=", ">"),
        ),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g1-eq",
        CHUNK,
        "G1 `>=` -> `==`: final only when progress lands exactly on the prompt",
        _g1(
            G1_PROGRESS,
            G1_PROGRESS.replace(">=", "=="),
        ),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g1-slack1",
        CHUNK,
        "G1 slack 1: `>= num_prompt_tokens - 1` (fires one token early)",
        _g1(
            G1_PROGRESS,
            G1_PROGRESS.replace("num_prompt_tokens\n", "num_prompt_tokens - 1\n"),
        ),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g1-slack2",
        CHUNK,
        "G1 slack 2: `>= num_prompt_tokens - 2` (the older script's default slack)",
        _g1(
            G1_PROGRESS,
            G1_PROGRESS.replace("num_prompt_tokens\n", "num_prompt_tokens - 2\n"),
        ),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g1-no-scheduled",
        CHUNK,
        "G1 without `num_scheduled_tokens` (progress before this step's chunk)",
        _g1(
            "        req.num_computed_tokens\n" + G1_PROGRESS,
            "        req.num_computed_tokens\n        >= req.num_prompt_tokens\n",
        ),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g1-new-blocks-only",
        CHUNK,
        "G1 back under `new_block_ids is not None` (a final chunk without a new block never sends)",
        _g1(
            "\nif req_id in self._reqs_need_pending_save:\n    req = self",
            "\nif new_block_ids is not None and req_id in self._reqs_need_pending_save:\n"
            "    req = self",
        ),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g1-default-1",
        CHUNK,
        "G1's `num_scheduled_tokens.get(req_id, 0)` default -> 1",
        _g1(
            G1_PROGRESS,
            G1_PROGRESS.replace("get(req_id, 0)", "get(req_id, 1)"),
        ),
        CHUNK_TREES,
        equivalent="G1 loops over scheduler_output.scheduled_cached_reqs, and every request in it "
        "has its entry in num_scheduled_tokens (vLLM's Scheduler fills both from the same "
        "scheduled set), so the default is never read",
    ),
    Variant(
        "chunk-g2-inverted",
        CHUNK,
        "G2 `<` -> `>=` (defers the final chunk, sends the first)",
        (Sub(CHUNK_DECL, G2_PROGRESS, G2_PROGRESS.replace("<", ">=")),),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g2-le",
        CHUNK,
        "G2 `<` -> `<=` (a one-chunk prompt is deferred past its only chunk)",
        (Sub(CHUNK_DECL, G2_PROGRESS, G2_PROGRESS.replace("<", "<=")),),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g2-slack2",
        CHUNK,
        "G2 slack 2: `< num_prompt_tokens - 2` (a new request within 2 tokens is sent at once)",
        (Sub(CHUNK_DECL, G2_PROGRESS, G2_PROGRESS.replace("tokens\n", "tokens - 2\n")),),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g2-no-scheduled",
        CHUNK,
        "G2 without `num_scheduled_tokens` (a one-chunk prompt reads as not final)",
        (
            Sub(
                CHUNK_DECL,
                "    req.num_computed_tokens\n" + G2_PROGRESS,
                "    req.num_computed_tokens\n    < req.num_prompt_tokens\n",
            ),
        ),
        CHUNK_TREES,
    ),
    # The older script's decisions on tree d, repaired in place by LEGACY_TEMPLATE (gates.py),
    # which k3patch reads back by its meaning, not by a stored shape.
    Variant(
        "chunk-legacy-gt",
        CHUNK,
        "the repaired decision `>=` -> `>` (tree d)",
        (Sub(CHUNK_LEGACY, "    >= {req}.num_prompt_tokens\n", "    > {req}.num_prompt_tokens\n"),),
        ("fork-d",),
    ),
    Variant(
        "chunk-legacy-slack2",
        CHUNK,
        "the repaired decision keeps a slack of 2 (tree d)",
        (
            Sub(
                CHUNK_LEGACY,
                "    >= {req}.num_prompt_tokens\n",
                "    >= {req}.num_prompt_tokens - 2\n",
            ),
        ),
        ("fork-d",),
    ),
    Variant(
        "chunk-legacy-no-scheduled",
        CHUNK,
        "the repaired decision without `num_scheduled_tokens` (tree d)",
        (
            Sub(
                CHUNK_LEGACY,
                "    + scheduler_output.num_scheduled_tokens.get({req_id}, 0)\n",
                "",
            ),
        ),
        ("fork-d",),
    ),
    Variant(
        "chunk-legacy-keeps-fallback",
        CHUNK,
        "the repair leaves the `if NAME is None:` block-count fallback in place (tree d)",
        (
            Sub(
                CHUNK_LEGACY,
                "stmts = [self.decision] if self.fallback is None else [self.decision, "
                "self.fallback]",
                "stmts = [self.decision]",
            ),
        ),
        ("fork-d",),
    ),
    # ---- moriio-group-routing: forms.py's texts are what apply writes and what it reads back.
    _routing(
        "routing-index-0",
        "the transfer plan indexes the group lists with [0] for every layer",
        Sub(
            ROUTING_FORMS,
            "        _k3patch_local[_k3patch_group],\n        _k3patch_remote[_k3patch_group],\n",
            "        _k3patch_local[0],\n        _k3patch_remote[0],\n",
        ),
    ),
    _routing(
        "routing-attention-first-group",
        "the attention group is the first group, Mamba or not",
        Sub(
            ROUTING_FORMS,
            "if attention_group is None and not isinstance(group.kv_cache_spec, MambaSpec):",
            "if attention_group is None:",
        ),
    ),
    _routing(
        "routing-cache-by-geometry",
        "the offsets cache keyed by tensor geometry alone (0.28.0's key)",
        Sub(
            ROUTING_FORMS,
            "geometry_key = (task.layer_name, *_get_write_geometry_key(layer_cache))",
            "geometry_key = _get_write_geometry_key(layer_cache)",
        ),
        trees=("fork-a", "fork-d"),
    ),
    _routing(
        "routing-cache-by-layer-only",
        "the offsets cache keyed by the layer name alone",
        Sub(
            ROUTING_FORMS,
            "geometry_key = (task.layer_name, *_get_write_geometry_key(layer_cache))",
            "geometry_key = (task.layer_name,)",
        ),
        eq="the cache lives in one request's RemoteAllocInfo, and a layer's KV cache tensor "
        "(its geometry) is allocated once per process: within a request a layer has one "
        "geometry, so the layer name alone keys the same entries",
    ),
    _routing(
        "routing-entry-not-removed",
        "the per-request group lists read, not removed, when their save leaves (`pop` -> `get`)",
        Sub(
            ROUTING_FORMS,
            "self._k3patch_save_groups.pop(\n            _k3patch_req_id, None",
            "self._k3patch_save_groups.get(\n            _k3patch_req_id, None",
        ),
    ),
    _routing(
        "routing-first-chunk-only",
        "the group lists never grow after the first chunk (later chunks' blocks dropped)",
        Sub(ROUTING_FORMS, "_k3patch_group + list(_k3patch_added)", "_k3patch_group"),
        trees=("fork-a", "fork-c"),
    ),
    _routing(
        "routing-growth-prepended",
        "a later chunk's blocks put before the earlier ones",
        Sub(
            ROUTING_FORMS,
            "_k3patch_group + list(_k3patch_added)",
            "list(_k3patch_added) + _k3patch_group",
        ),
    ),
    _routing(
        "routing-no-saves-inverted",
        "`if self._k3patch_save_groups:` inverted (the lists never reach the metadata)",
        Sub(
            ROUTING_FORMS, "if self._k3patch_save_groups:\n", "if not self._k3patch_save_groups:\n"
        ),
    ),
    _routing(
        "routing-notify-without-external",
        "decode notify sends the group lists also with `num_external_tokens == 0` (`>` -> `>=`)",
        Sub(
            ROUTING_FORMS,
            "_k3_gbi_d] if num_external_tokens > 0 else []",
            "_k3_gbi_d] if num_external_tokens >= 0 else []",
        ),
    ),
    _routing(
        "routing-notify-first-group",
        "decode notify sends only the first group's blocks",
        Sub(
            ROUTING_FORMS,
            "[list(_k3patch_g) for _k3patch_g in _k3_gbi_d]",
            "[list(_k3patch_g) for _k3patch_g in _k3_gbi_d[:1]]",
        ),
    ),
    _routing(
        "routing-capture-two-groups",
        "the prefill capture keeps two groups, as the fork did (`_k3_gbi[:2]`)",
        Sub(
            ROUTING_FORMS,
            "    list(_k3patch_g) for _k3patch_g in _k3_gbi\n]",
            "    list(_k3patch_g) for _k3patch_g in _k3_gbi[:2]\n]",
        ),
    ),
    _routing(
        "routing-write-task-none",
        "the metadata's group lists not handed to schedule_write_blocks (None passed)",
        Sub(ROUTING_DECL, 'f"{FIELD_NAME}=meta.{FIELD_NAME}"', 'f"{FIELD_NAME}=None"'),
    ),
    _routing(
        "routing-peer-check-and",
        "the missing-peer check `or` -> `and` (a one-sided peer fails later, not by MoRIIOError)",
        Sub(
            ROUTING_FORMS,
            "if _k3patch_local is None or _k3patch_remote is None:",
            "if _k3patch_local is None and _k3patch_remote is None:",
        ),
    ),
    # ---- kda-gather-diagnostic: GATE is both the rewrite's header and the applied shape's test.
    _kda(
        "kda-gate-default-1",
        "the gate's default `'0'` -> `'1'` (syncs unless told not to)",
        Sub(KDA_DECL, GATE, GATE.replace('"0"', '"1"')),
    ),
    _kda(
        "kda-gate-other-variable",
        "the gate reads another variable (K3_KDA_LOG)",
        Sub(KDA_DECL, GATE, GATE.replace("{ENV}", "K3_KDA_LOG")),
    ),
    _kda(
        "kda-gate-inverted",
        "the gate `== '1'` -> `!= '1'`",
        Sub(KDA_DECL, GATE, GATE.replace('== "1"', '!= "1"')),
    ),
    _kda(
        "kda-gate-truthy",
        "the gate tests the string's truth (`os.environ.get(VAR, '0')`: '0' is true)",
        Sub(KDA_DECL, GATE, GATE.replace(' == "1"', "")),
    ),
    _kda(
        "kda-bool-outside-gate",
        "a bool() sync in the gate's own test, before the variable is read",
        Sub(KDA_DECL, GATE, GATE.replace("f'os", "f'bool((_safe_idx < 0).any()) or os")),
    ),
    _kda(
        "kda-clamp-removed",
        "the rewrite drops the guard's clamp (and the guard shape accepts any index expression)",
        Sub(
            KDA_DECL,
            "    indices.to(torch.int64).CLAMP(0, _n_state_blocks - 1),",
            "    HOLE_safe_index,",
        ),
        Sub(KDA_DECL, KDA_NEST, KDA_NEST + KDA_UNCLAMP),
    ),
)


# ---- issue 28: the classes the oracles were built for (rows of the oracles branch, kept
# together here; the lead merges them with the table of new wrong fixes written elsewhere).
KDA_NO_LOWER_BOUND = KDA_UNCLAMP.replace(
    "indices.to(torch.int64), ", "indices.to(torch.int64).clamp(max=_n_state_blocks - 1), "
)
ROUTING_CACHE = """geometry_key = (task.layer_name, *_get_write_geometry_key(layer_cache))
offsets = request_info.transfer_offsets.get(geometry_key)
"""
# The request's offsets dict swapped for one the worker keeps (the first request's, shared).
ROUTING_CACHE_PER_WORKER = ROUTING_CACHE.replace(
    "offsets = ",
    "request_info.transfer_offsets = vars(self.worker).setdefault(\n"
    '    "_k3patch_offsets", request_info.transfer_offsets\n)\noffsets = ',
)
ORACLE_VARIANTS: tuple[Variant, ...] = (
    Variant(
        "chunk-g1-step-total",
        CHUNK,
        "G1 counts the whole step's scheduled tokens (`total_num_scheduled_tokens`), not this "
        "request's: the save leaves a chunk early whenever other requests share the step",
        _g1(
            G1_PROGRESS,
            G1_PROGRESS.replace(
                "num_scheduled_tokens.get(req_id, 0)", "total_num_scheduled_tokens"
            ),
        ),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g2-step-total",
        CHUNK,
        "G2 counts the whole step's scheduled tokens, not this request's",
        (
            Sub(
                CHUNK_DECL,
                G2_PROGRESS,
                G2_PROGRESS.replace(
                    "num_scheduled_tokens.get(req_id, 0)", "total_num_scheduled_tokens"
                ),
            ),
        ),
        CHUNK_TREES,
    ),
    Variant(
        "chunk-g2-ignores-computed",
        CHUNK,
        "G2 ignores tokens already computed (a prefix-cache hit at the first step defers the "
        "save and, with one output token, it never leaves)",
        (Sub(CHUNK_DECL, "    req.num_computed_tokens\n" + G2_PROGRESS, "    0\n" + G2_PROGRESS),),
        CHUNK_TREES,
    ),
    _routing(
        "routing-growth-first-request",
        "the per-chunk growth reads the first request's new blocks for every request of the batch",
        Sub(ROUTING_FORMS, "new_block_ids[_k3patch_index]", "new_block_ids[0]"),
    ),
    _routing(
        "routing-cache-per-worker",
        "the offsets cache kept on the worker, not per request: later requests write into the "
        "first one's decode blocks",
        Sub(ROUTING_FORMS, ROUTING_CACHE, ROUTING_CACHE_PER_WORKER),
    ),
    _aiter(
        "aiter-explicit-few-spellings",
        '"set explicitly" judged by a few spellings: `=True` on gfx942 is overridden',
        'if envs.is_set("VLLM_ROCM_USE_AITER_MLA"):',
        'if os.environ.get("VLLM_ROCM_USE_AITER_MLA") in ("0", "1", "true", "false"):',
    ),
    _kda(
        "kda-clamp-no-lower-bound",
        "the guard's clamp loses its lower bound: a negative index reaches the kernel",
        Sub(
            KDA_DECL,
            "    indices.to(torch.int64).CLAMP(0, _n_state_blocks - 1),",
            "    HOLE_safe_index,",
        ),
        Sub(KDA_DECL, KDA_NEST, KDA_NEST + KDA_NO_LOWER_BOUND),
    ),
    _kda(
        "kda-constant-changed",
        "the patch's own variable name changes (K3_KDA_LOG): a probe that reads the constant "
        "sets the same wrong name and passes",
        Sub("kda_gather_diagnostic/syncs.py", 'ENV = "K3_KDA_GATHER_LOG"', 'ENV = "K3_KDA_LOG"'),
    ),
)
VARIANTS += ORACLE_VARIANTS


# --------------------------------------------------------------------------------------------
# The table against today's declarations (also what tests/test_mutants_table.py checks).


def table_errors(patches_dir: Path, variants: Sequence[Variant] = VARIANTS) -> dict[str, str]:
    """variant id -> why its substitutions cannot be made exactly once; empty when all can."""
    errors: dict[str, str] = {}
    for v in variants:
        texts: dict[str, str | None] = {}  # each file as the variant's earlier subs left it
        for sub in v.subs:
            path = patches_dir / sub.file
            if sub.file not in texts:
                texts[sub.file] = path.read_text(encoding="utf-8") if path.is_file() else None
            text = texts[sub.file]
            original = path.read_text(encoding="utf-8") if path.is_file() else ""
            count = 0 if text is None else min(text.count(sub.old), original.count(sub.old))
            if count != 1 or sub.old == sub.new or text is None:
                first = sub.old.strip().splitlines()[0] if sub.old.strip() else repr(sub.old)
                why = "no change" if sub.old == sub.new else f"found {count} times (want 1)"
                errors[v.id] = f"{sub.file}: `{first}` {why}"
                break
            texts[sub.file] = text.replace(sub.old, sub.new, 1)
    return errors


def mutated(patches_dir: Path, variant: Variant) -> dict[str, str]:
    """The declaration files as the variant changes them (file -> text)."""
    texts: dict[str, str] = {}
    for sub in variant.subs:
        text = texts.get(sub.file) or (patches_dir / sub.file).read_text(encoding="utf-8")
        texts[sub.file] = text.replace(sub.old, sub.new, 1)
    return texts


# --------------------------------------------------------------------------------------------
# Running a variant.


@dataclass
class TreeResult:
    tree: str
    outcome: str  # "A" killed by apply, "P" killed by probes, "S" survived, "E" error
    detail: str = ""


@dataclass
class Result:
    variant: Variant
    trees: list[TreeResult] = field(default_factory=list)
    tests: str = ""  # "killed", "passed", "not run", or an error
    tests_detail: str = ""
    error: str = ""

    @property
    def by_apply(self) -> bool:
        return bool(self.trees) and all(t.outcome == "A" for t in self.trees)

    @property
    def by_probes(self) -> bool:
        return any(t.outcome == "P" for t in self.trees)

    @property
    def survived(self) -> bool:
        return any(t.outcome == "S" for t in self.trees)

    def verdict(self) -> str:
        if self.error or any(t.outcome == "E" for t in self.trees):
            return "error"
        if self.survived:
            return "survived (equivalent)" if self.variant.equivalent else "SURVIVED"
        return "killed by apply" if self.by_apply else "killed by probes"


def export(source: str, dest: Path) -> Path:
    """k3patch/, patches/ (as k3patch/patches), tests/, fixtures/ and pyproject.toml of the
    checkout: the last commit (HEAD) or the working tree as it is."""
    parts = ["k3patch", "patches", "tests", "fixtures", "pyproject.toml"]
    raw = dest / "raw"
    raw.mkdir(parents=True)
    if source == "worktree":
        for part in parts:
            src = ROOT / part
            if src.is_dir():
                shutil.copytree(src, raw / part, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, raw / part)
    else:
        archive = dest / "src.tar"
        with open(archive, "wb") as out:
            subprocess.run(["git", "archive", source, *parts], cwd=ROOT, stdout=out, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(raw, filter="data")
    lib = dest / "lib"
    lib.mkdir()
    shutil.copytree(raw / "k3patch", lib / "k3patch")
    shutil.copytree(raw / "patches", lib / "k3patch" / "patches")
    for part in ("tests", "fixtures", "pyproject.toml"):
        if (raw / part).is_dir():
            shutil.copytree(raw / part, lib / part)
        elif (raw / part).exists():
            shutil.copy2(raw / part, lib / part)
    return lib


def scratch_copy(clean: Path, variant: Variant | None, where: Path) -> Path:
    lib = where / "lib"
    shutil.copytree(clean, lib)
    if variant is not None:
        for rel, text in mutated(clean / "k3patch" / "patches", variant).items():
            (lib / "k3patch" / "patches" / rel).write_text(text, encoding="utf-8")
    return lib


def source_tree(name: str) -> Path:
    """A cached read-only tree: "0.31.0" (an upstream wheel) or "fork-a" (tests/forktree)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest

    if name.startswith("fork-"):
        return conftest.built_fork_tree(name.removeprefix("fork-"))
    return conftest.pristine_tree(name)


def k3patch(lib: Path, *args: str, timeout: int = 600) -> tuple[int, dict, str]:
    env = {**os.environ, "PYTHONPATH": str(lib), "NO_COLOR": "1", "K3PATCH_NO_FASTPATH": "1"}
    env.pop("PYTHONSAFEPATH", None)
    proc = subprocess.run(
        [str(DEV_PYTHON), "-m", "k3patch", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=lib.parent,  # never the checkout: `-m` puts the cwd first on sys.path
        timeout=timeout,
    )
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        data = {}
    return proc.returncode, data, (proc.stderr or proc.stdout).strip()[-400:]


def _verdict(data: dict, patch: str) -> tuple[str, str]:
    for p in data.get("patches", []):
        if p["id"] == patch:
            bad = [s for s in p.get("sites", []) if s["verdict"] != "applied"]
            return p["verdict"], (bad[0]["site"] + ": " + bad[0]["detail"]) if bad else ""
    return "missing", data.get("error", "")


def run_tree(lib: Path, variant: Variant | None, patch: str, tree: str, work: Path) -> TreeResult:
    site = work / f"tree-{tree}"
    shutil.copytree(source_tree(tree), site, ignore=shutil.ignore_patterns(".complete"))
    try:
        rc, data, err = k3patch(lib, "status", "--vllm", str(site), "--only", patch)
        before, _ = _verdict(data, patch)
        if before != "pending":
            return TreeResult(tree, "E", f"{patch} reads {before} before apply, not pending {err}")
        rc, data, err = k3patch(lib, "apply", "--vllm", str(site))
        after, why = _verdict(data, patch)
        if rc != 0 or after != "applied":
            return TreeResult(tree, "A", f"apply exit {rc}, {patch} {after}: {why or err}"[:300])
        only = [a for p in VERIFY_WITH[patch] for a in ("--only", p)]
        args = ("verify", "--vllm", str(site), "--python", str(TREE_PYTHON), *only)
        rc, data, err = k3patch(lib, *args)
        if "verify" not in data:
            return TreeResult(tree, "E", f"verify exit {rc}: {err}")
        failed = []
        for check in data["verify"]["patches"]:
            broken = [m["module"] for m in check["modules"] if m["status"] != "ok"]
            probe = check["probe"]
            if broken:
                failed.append(f"{check['id']}: module {broken[0]} {check['modules'][0]['reason']}")
            elif probe["ok"] is False:
                failed.append(f"{check['id']}: {probe['summary']}")
            elif not probe["ran"]:
                failed.append(f"{check['id']}: probe not run")
        if failed:
            return TreeResult(tree, "P", "; ".join(failed)[:400])
        return TreeResult(tree, "S", "applied; every probe passed")
    finally:
        shutil.rmtree(site, ignore_errors=True)


def run_tests(lib: Path, patch: str) -> tuple[str, str]:
    env = {**os.environ, "PYTHONPATH": str(lib), "NO_COLOR": "1"}
    cmd = [str(DEV_PYTHON), "-m", "pytest", *TEST_ARGS, *TESTS[patch]]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, cwd=lib, timeout=TEST_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return "timeout", f"over {TEST_TIMEOUT} s"
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    last = proc.stdout.strip().splitlines()[-1:] or ["no output"]
    if proc.returncode == 0:
        return "passed", last[0]
    if proc.returncode == 1:
        return "killed", (failed[0] if failed else last[0])[:300]
    return "error", f"pytest exit {proc.returncode}: {last[0]}"[:300]


# --------------------------------------------------------------------------------------------
# The report.


def report_lines(results: list[Result], errors: dict[str, str], baseline: list[str]) -> list[str]:
    lines = ["| variant | patch | what it changes | trees | apply | probes | tests | result |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in results:
        v = r.variant
        trees = ", ".join(f"{t.tree}: {t.outcome}" for t in r.trees) or "-"
        apply = "killed" if r.by_apply else "accepted"
        probes = "killed" if r.by_probes else "-" if r.by_apply else "passed"
        lines.append(
            f"| `{v.id}` | {v.patch} | {v.what} | {trees} | {apply} | {probes} | {r.tests} "
            f"| {r.verdict()} |"
        )
    for vid, why in errors.items():
        lines.append(f"| `{vid}` | | TABLE ERROR: {why} | | | | | error |")
    total = len(results)
    count = {
        "apply": sum(r.verdict() == "killed by apply" for r in results),
        "probes": sum(r.verdict() == "killed by probes" for r in results),
        "equivalent": sum(r.verdict() == "survived (equivalent)" for r in results),
        "survived": sum(r.verdict() == "SURVIVED" for r in results),
        "error": sum(r.verdict() == "error" for r in results),
    }
    only_tests = [
        r.variant.id for r in results if r.verdict() == "SURVIVED" and r.tests == "killed"
    ]
    lines += [
        "",
        f"{total} variants run: {count['apply']} killed by apply, {count['probes']} killed by "
        f"probes, {count['survived']} survived, {count['equivalent']} survived as declared "
        f"equivalent, {count['error']} errors; {len(errors)} table errors.",
        f"Killed by the test subset too: {sum(r.tests == 'killed' for r in results)}; survivors "
        f"that only the tests catch: {', '.join(only_tests) or 'none'}.",
        "",
        "Baseline (the unmutated copy): " + "; ".join(baseline),
        "",
        "Survivors and their reasons:",
        "",
    ]
    for r in results:
        if r.survived:
            why = r.variant.equivalent or "NONE DECLARED: a probe case is missing"
            alive = ", ".join(t.tree for t in r.trees if t.outcome == "S")
            lines.append(f"- `{r.variant.id}` (survived on {alive}): {why}")
    if not any(r.survived for r in results):
        lines.append("- none")
    lines += ["", "Kills, what caught each (first failing check per tree):", ""]
    for r in results:
        for t in r.trees:
            if t.outcome in ("A", "P", "E"):
                lines.append(f"- `{r.variant.id}` {t.tree} ({t.outcome}): {t.detail}")
        if r.tests == "killed":
            lines.append(f"- `{r.variant.id}` tests: {r.tests_detail}")
    return lines


def write_results(lines: list[str], command: str, tests: str) -> None:
    today = datetime.date.today().isoformat()
    section = [
        "## Mutants",
        "",
        f"`{command}`, {today} (A: killed by apply, P: killed by probes, S: survived; tests: "
        f"{', '.join(t for ts in TESTS.values() for t in ts)} with `{' '.join(TEST_ARGS)}`, "
        f"run on {'the variants verify let through' if tests == 'survivors' else tests}):",
        "",
        *lines,
        "",
    ]
    text = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else ""
    start = text.find("\n## Mutants\n")
    if start == -1:
        new = text.rstrip("\n") + "\n\n" + "\n".join(section)
    else:
        end = text.find("\n## ", start + 1)
        tail = text[end:] if end != -1 else "\n"
        new = text[: start + 1] + "\n".join(section) + tail
    RESULTS.write_text(new, encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="VARIANT")
    parser.add_argument("--patch", action="append", default=[], metavar="ID")
    parser.add_argument("--trees", help="comma-separated; each variant runs on those it lists")
    parser.add_argument("--source", default="HEAD", help="a git revision, or 'worktree'")
    parser.add_argument(
        "--tests",
        choices=("survivors", "all", "none"),
        default="survivors",
        help="run the test subset on the variants verify let through (default), on all, or none",
    )
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    args = parser.parse_args(argv)

    known = {v.id for v in VARIANTS}
    unknown = [vid for vid in args.only if vid not in known]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; see --list")
    chosen = [
        v
        for v in VARIANTS
        if (not args.only or v.id in args.only) and (not args.patch or v.patch in args.patch)
    ]
    trees_wanted = set(args.trees.split(",")) if args.trees else None
    if args.list:
        for v in chosen:
            print(f"{v.id:34} {v.patch:22} {','.join(v.trees):18} {v.what}")
        return 0

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="k3patch-mutants-") as tmp:
        work = Path(tmp)
        clean = export(args.source, work / "export")
        errors = table_errors(clean / "k3patch" / "patches", chosen)
        for vid, why in errors.items():
            print(f"TABLE ERROR {vid}: {why}", file=sys.stderr, flush=True)
        runnable = [v for v in chosen if v.id not in errors]

        def trees_of(v: Variant) -> list[str]:
            return [t for t in v.trees if trees_wanted is None or t in trees_wanted]

        # The baseline: the unmutated copy applies and verifies on every tree, tests pass.
        baseline: list[str] = []
        bad_base: set[tuple[str, str]] = set()
        base = scratch_copy(clean, None, work / "base")
        for patch, tree in sorted({(v.patch, t) for v in runnable for t in trees_of(v)}):
            got = run_tree(base, None, patch, tree, work)
            baseline.append(f"{patch} on {tree}: {got.outcome} ({got.detail})")
            print("baseline", baseline[-1], flush=True)
            if got.outcome != "S":
                bad_base.add((patch, tree))
        base_tests: dict[str, str] = {}

        def tests_pass_unmutated(patch: str) -> bool:
            if patch not in base_tests:
                base_tests[patch], detail = run_tests(base, patch)
                baseline.append(f"tests of {patch}: {base_tests[patch]} ({detail})")
                print("baseline", baseline[-1], flush=True)
            return base_tests[patch] == "passed"

        results = []
        for v in runnable:
            result = Result(v)
            where = work / v.id
            where.mkdir()
            lib = scratch_copy(clean, v, where)
            for tree in trees_of(v):
                if (v.patch, tree) in bad_base:
                    result.trees.append(TreeResult(tree, "E", "the unmutated baseline fails here"))
                    continue
                try:
                    result.trees.append(run_tree(lib, v, v.patch, tree, where))
                except Exception as exc:  # one variant's failure is reported, not the run's end
                    result.trees.append(TreeResult(tree, "E", f"{type(exc).__name__}: {exc}"))
            if args.tests == "none" or (args.tests == "survivors" and not result.survived):
                result.tests = "not run"
            elif not tests_pass_unmutated(v.patch):
                result.tests = "baseline fails"
            else:
                result.tests, result.tests_detail = run_tests(lib, v.patch)
            shutil.rmtree(where, ignore_errors=True)
            trees = ", ".join(f"{t.tree}: {t.outcome}" for t in result.trees)
            print(f"{v.id}: {result.verdict()} [{trees}] tests {result.tests}", flush=True)
            for t in result.trees:
                print(f"    {t.tree} {t.outcome}: {t.detail}", flush=True)
            results.append(result)

    elapsed = time.monotonic() - started
    lines = report_lines(results, errors, baseline)
    lines.append("")
    lines.append(f"Wall time {elapsed / 60:.1f} min.")
    print("\n".join(lines))
    full = not (args.only or args.patch or args.trees)
    if full and not args.no_write:
        command = "benchmarks/mutants.py" + (f" --source {args.source}" if args.source else "")
        command += f" --tests {args.tests}" if args.tests != "survivors" else ""
        write_results(lines, ".venv/bin/python " + command, args.tests)
    return 1 if errors or any(r.verdict() in ("SURVIVED", "error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
