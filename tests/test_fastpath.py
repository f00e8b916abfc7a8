"""The no-op path answers exactly as the full path does, without importing libcst, typer or
rich, and steps aside the moment anything differs from the state record or the command is not
a form it serves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import run_cli, slow_after, tree_hashes

from k3patch import scan
from k3patch.tree import locate

pytestmark = pytest.mark.wheel
VERSIONS = ["0.29.0", "0.31.0", "0.33.0"]

PROBE = """
import io, sys
from contextlib import redirect_stdout
from k3patch.fastpath import try_fast
buf = io.StringIO()
with redirect_stdout(buf):
    code = try_fast(sys.argv[1:])
heavy = sorted(m for m in ("libcst", "typer", "rich", "click") if m in sys.modules)
sys.stdout.write(repr((code, heavy)) + "\\n" + buf.getvalue())
"""


def fast(*args: str) -> tuple[int | None, list[str], str]:
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=True
    )
    first, _, rest = proc.stdout.partition("\n")
    code, heavy = eval(first)  # a repr of (int | None, list[str]) we printed ourselves
    return code, heavy, rest


def unmark(text: str) -> str:
    return text.replace('"from_record": true', '"from_record": false').replace(
        "  (from the state record)", ""
    )


def full(*args: str) -> subprocess.CompletedProcess:
    return run_cli(*args, env={"K3PATCH_NO_FASTPATH": "1"})


COMMANDS = [
    ["status", "--json"],
    ["status"],
    ["status", "--quiet"],
    ["status", "--digest"],
    ["apply", "--quiet"],
    ["apply", "--json"],
    ["status", "--json", "--only", "aiter-mla-gfx942"],
    # In a log (not a terminal) the human reports are served too, line for line the same.
    ["apply"],
    ["status", "--sites"],
    ["apply", "--sites"],
    # Options as click reads them: `=` values, repeated ids, the last value winning.
    ["status", "-q", "--skip=kda-gather-diagnostic", "--skip", "moriio-chunk-gate"],
    ["apply", "--json", "--lock-timeout", "5", "--lock-timeout=7", "--only=aiter-mla-gfx942"],
    ["status", "--digest", "--lock-timeout=0"],
]


@pytest.mark.parametrize("version", slow_after(VERSIONS))
def test_fast_and_full_paths_agree_on_applied_trees(make_tree, version):
    site = make_tree(version)
    assert run_cli("apply", "--vllm", str(site)).returncode in (0, 1)
    for args in COMMANDS:
        code, heavy, out = fast(*args, "--vllm", str(site))
        assert code is not None, f"fast path declined {args}"
        assert heavy == [], f"{args} imported {heavy}"
        reference = full(*args, "--vllm", str(site))
        assert code == reference.returncode, args
        # The full path classified the code itself; only the "from the record" marks differ.
        assert unmark(out) == unmark(reference.stdout), args
    # And the record agrees with a classification made from scratch.
    tree = locate(site)
    fresh = scan.scan(tree, use_record=False)
    recorded = scan.scan(tree)
    assert recorded.from_record and not fresh.from_record
    assert [r.to_json() for r in fresh.results] == [r.to_json() for r in recorded.results]


def test_fast_path_steps_aside_when_a_byte_changes(make_tree):
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    assert fast("status", "--vllm", str(site))[0] == 0
    target = site / "vllm" / "_aiter_ops.py"
    target.write_bytes(target.read_bytes() + b"\n# a comment\n")
    code, _, _ = fast("status", "--vllm", str(site))
    assert code is None
    # The full path still classifies it (a comment does not change the verdict).
    data = json.loads(run_cli("status", "--vllm", str(site), "--json").stdout)
    assert data["patches"][0]["verdict"] == "applied" and data["from_record"] is False


@pytest.mark.parametrize(
    "args",
    slow_after(
        [
            ["apply", "--diff"],
            ["apply", "--check"],
            ["apply", "--diff", "--quiet"],
            ["status", "--only", "no-such-patch"],
            ["verify"],
            ["status", "--bogus"],
            ["status", "--lock-timeout", "-1"],  # the CLI's refusal
            ["apply", "--lock-timeout", "nan"],
            ["apply", "--lock-timeout=-1"],
            ["apply", "--all-or-nothing"],
            ["status", "--vllm"],
            ["status", "--", "--json"],
            ["apply", "--digest"],
        ]
    ),
)
def test_fast_path_declines_what_it_does_not_serve(make_tree, args):
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    assert fast(*args, "--vllm", str(site))[0] is None


@pytest.mark.parametrize("mode", slow_after(["--quiet", "--json", "--sites", None]))
def test_cold_apply_goes_to_the_full_path_and_writes_the_same(make_tree, mode):
    """The entrypoint's cold start: `apply` with work to do is not the no-op path's. It hands
    over without writing, and `k3patch apply` (no-op path first, then the CLI) prints and writes
    exactly what the CLI alone does."""
    lean_site, full_site = make_tree("0.31.0"), make_tree("0.31.0")
    mode_args = [mode] if mode else []
    before = tree_hashes(lean_site / "vllm")
    assert fast("apply", *mode_args, "--vllm", str(lean_site))[0] is None
    assert tree_hashes(lean_site / "vllm") == before
    both = run_cli("apply", *mode_args, "--vllm", str(lean_site))
    reference = full("apply", *mode_args, "--vllm", str(full_site))
    assert both.returncode == reference.returncode == 0
    assert both.stdout == reference.stdout.replace(str(full_site), str(lean_site))
    assert tree_hashes(lean_site / "vllm") == tree_hashes(full_site / "vllm")


def test_cold_quiet_apply_reports_drift_like_the_cli(make_tree):
    site, other = make_tree("0.31.0"), make_tree("0.31.0")
    for tree in (site, other):
        target = tree / "vllm" / "_aiter_ops.py"
        text = target.read_text().replace("cls._AITER_ENABLED and", "cls._AITER_ENABLED or")
        target.write_text(text)
    both = run_cli("apply", "--quiet", "--vllm", str(site))
    reference = full("apply", "--quiet", "--vllm", str(other))
    assert both.returncode == reference.returncode == 1
    assert both.stdout == reference.stdout.replace(str(other), str(site))
    out = both.stdout
    # The drifted patch is refused on its own; the chunk gate (pending on 0.31.0) is applied.
    assert "k3patch: aiter-mla-gfx942: drifted" in out
    assert "k3patch: moriio-chunk-gate: applied" in out
    assert "refused: aiter-mla-gfx942 (drifted)" in out


def test_fast_path_declines_journals(make_tree):
    site = make_tree("0.31.0")
    run_cli("apply", "--vllm", str(site), env={"K3PATCH_TEST_CRASH_AT": "kept-removed"})
    assert (site / "vllm" / ".k3patch" / "journal.json").exists()
    assert fast("status", "--vllm", str(site))[0] is None


@pytest.mark.parametrize(
    "args",
    slow_after(
        [
            ["apply", "--lock-timeout", "-1"],
            ["apply", "--lock-timeout", "nan"],
            ["apply", "--lock-timeout", "abc"],
            ["apply", "--lock-timeout=inf"],
            ["apply", "--lock-timeout", "1e999"],
            ["apply", "--lock-timeout="],
            ["apply", "--json", "--lock-timeout", "-0.5"],
            ["status", "--lock-timeout", "-1"],  # status reads it as apply does
            ["status", "--check"],
            ["status", "--all-or-nothing"],
            ["apply", "--digest"],
            ["apply", "--quiet", "--only"],
            ["status", "--only", "no-such-patch"],
        ]
    ),
)
def test_options_mean_the_same_on_the_no_op_path(make_tree, args):
    """Issue 21 item 8: on a tree the no-op path could answer, every option is validated
    exactly as the full path validates it (or handed over): the same exit code, usage errors
    2, the same stdout."""
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    both = run_cli(*args, "--vllm", str(site))
    reference = full(*args, "--vllm", str(site))
    assert both.returncode == reference.returncode == 2, (both.stdout, both.stderr)
    assert both.stdout == reference.stdout
    assert len(both.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "value", slow_after(["0", "5", "7.5", " 5", "1_0", "0x10", "1e2"]), ids=lambda v: repr(v)
)
def test_a_lock_timeout_is_read_as_click_reads_it(make_tree, value):
    """What click's FLOAT takes the no-op path takes (and the same code comes out); what it
    refuses is handed over."""
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    args = ["apply", "--quiet", "--lock-timeout", value, "--vllm", str(site)]
    code, _, _ = fast(*args)
    reference = full(*args)
    if code is None:
        assert reference.returncode == 2 or run_cli(*args).returncode == reference.returncode
    else:
        assert code == reference.returncode


@pytest.mark.parametrize("value", ["\uff15", "\u0665"])  # FULLWIDTH FIVE, ARABIC-INDIC FIVE
def test_the_no_op_path_refuses_a_lock_timeout_the_cli_refuses(make_tree, value):
    """A --lock-timeout of a Unicode digit (which Python's float() reads) is a usage error on
    the no-op path as on the full path: exit 2 on both, never 0 on one."""
    site = make_tree("0.31.0")
    assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    args = ("apply", "--quiet", "--vllm", str(site), "--lock-timeout", value)
    fast = run_cli(*args)
    slow = run_cli(*args, env={"K3PATCH_NO_FASTPATH": "1"})
    assert (fast.returncode, slow.returncode) == (slow.returncode, 2), (fast.stderr, slow.stderr)
