"""kda-gather-diagnostic's wrong fixes: GATE is both the rewrite's header and the applied shape's
test; ENV (syncs.py) is the variable's name everywhere the patch reads it."""

from __future__ import annotations

from .common import FIRST, ISSUE_28, KDA, KDA_DECL, KDA_REWRITE, KDA_SYNCS, Sub, Variant

GATE = """GATE = f'os.environ.get("{ENV}", "0") == "1"'"""
TREES = ("fork-a", "fork-b")
# The rewrite's gate step, and a step after it that rewrites the guard's index expression.
KDA_NEST = '                codemod.nest_under([node], f"if {GATE}:")\n'
GUARD_INDEX = "    indices.to(torch.int64).CLAMP(0, _n_state_blocks - 1),"


def rewrite_index(expr: str) -> str:
    """A rewrite step (after the gate's) that writes `_safe_idx` with `expr` as its index."""
    return f"""\
                function = astkit.find_def(sources[site.file].tree, site.name)
                safe = [s for s in function.body if astkit.bindings([s], "_safe_idx")]
                codemod.replace(
                    safe[:1],
                    "_safe_idx = torch.where(has_initial_state, {expr}, "
                    "torch.zeros_like(indices, dtype=torch.int64))",
                )
"""


def _kda(id: str, what: str, *subs: Sub, written: str = FIRST) -> Variant:
    return Variant(id, KDA, what, subs, TREES, written=written)


def _gate(id: str, what: str, gate: str) -> Variant:
    """A gate test other than GATE, written with `{ENV}` for the variable."""
    return _kda(id, what, Sub(KDA_DECL, GATE, f"GATE = f'{gate}'"), written=ISSUE_28)


def _index(id: str, what: str, expr: str) -> Variant:
    """The guard's index as `expr` (the guard shape then accepts any index expression)."""
    return _kda(
        id,
        what,
        Sub(KDA_DECL, GUARD_INDEX, "    HOLE_safe_index,"),
        Sub(KDA_REWRITE, KDA_NEST, KDA_NEST + rewrite_index(expr)),
        written=ISSUE_28,
    )


VARIANTS: tuple[Variant, ...] = (
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
        Sub(KDA_DECL, GUARD_INDEX, "    HOLE_safe_index,"),
        Sub(
            KDA_REWRITE,
            KDA_NEST,
            KDA_NEST + rewrite_index("indices.to(torch.int64)"),
        ),
    ),
    # ---- issue 28: written before its probes were extended.
    _kda(
        "kda-env-constant-renamed",
        "the patch's own constant says K3_KDA_GATHER_LOGS: the gate ignores K3_KDA_GATHER_LOG=1 "
        "(a probe that reads the constant cannot see it change)",
        Sub(KDA_SYNCS, 'ENV = "K3_KDA_GATHER_LOG"', 'ENV = "K3_KDA_GATHER_LOGS"'),
        written=ISSUE_28,
    ),
    _gate(
        "kda-gate-any-value",
        "the gate is the variable's truth (`os.environ.get(VAR)`): K3_KDA_GATHER_LOG=0, as "
        "launchers write it to say off, syncs on every call",
        'os.environ.get("{ENV}")',
    ),
    _gate(
        "kda-gate-not-zero",
        "the gate is `!= '0'`: =false, =no, =off or an empty value sync on every call",
        'os.environ.get("{ENV}", "0") != "0"',
    ),
    _gate(
        "kda-gate-int",
        "the gate parses the value as an int: =true raises ValueError in every prefill chunk, "
        "=2 syncs",
        'int(os.environ.get("{ENV}", "0"))',
    ),
    _gate(
        "kda-gate-log-level",
        "the diagnostic gated by vLLM's log level (VLLM_LOGGING_LEVEL=DEBUG), not by its own "
        "variable: K3_KDA_GATHER_LOG=1 logs nothing, a debug run syncs",
        'os.environ.get("VLLM_LOGGING_LEVEL", "INFO") == "DEBUG"',
    ),
    _index(
        "kda-clamp-no-lower-bound",
        "the rewrite tidies the clamp to `clamp(max=n - 1)`: a negative index reaches the kernel",
        "indices.to(torch.int64).clamp(max=_n_state_blocks - 1)",
    ),
    _index(
        "kda-clamp-upper-off-by-one",
        "the rewrite's clamp upper bound is `n`, not `n - 1`: index n (one past the pool) reaches "
        "the kernel",
        "indices.to(torch.int64).clamp(0, _n_state_blocks)",
    ),
)
