"""kill -9 at random moments across real applies and reverts of a real 0.31.0 tree: after the
next run of the same command, every tree is fully patched (or fully original), byte for byte,
and `status` agrees. The long campaign for the README is benchmarks/reliability.py."""

from __future__ import annotations

import signal

import pytest
from crash_campaign import campaign

pytestmark = [pytest.mark.wheel, pytest.mark.slow]


@pytest.fixture
def pristine(make_tree):
    return make_tree("0.31.0")


def test_random_kills_during_apply(pristine, tmp_path):
    result = campaign(pristine, tmp_path, runs=50, op="apply", seed=1)
    assert result.runs == 50
    assert result.killed_mid_run >= 25, "most kills should land while k3patch runs"
    assert result.failures == []
    assert result.mixed_after_recovery == 0


def test_random_kills_during_revert(pristine, tmp_path):
    result = campaign(pristine, tmp_path, runs=20, op="revert", seed=2)
    assert result.killed_mid_run >= 10
    assert result.failures == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("op", ["apply", "revert"])
def test_sigterm_and_sigint_at_random_moments(pristine, tmp_path, sig, op):
    """`docker stop` sends SIGTERM; a terminal sends SIGINT (KeyboardInterrupt, which rolls
    back in-process): either way the next run finds a whole tree."""
    result = campaign(pristine, tmp_path, runs=8, op=op, seed=3, sig=sig)
    assert result.killed_mid_run >= 4
    # The signal reached k3patch (a SIGINT inherited as ignored would not: conftest.interruptible).
    assert result.stopped_by_it >= 2, result
    assert result.failures == []
