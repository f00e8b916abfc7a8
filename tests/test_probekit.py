"""The probe kit: every stand-in is undone, also when the probe raises; checks become one
outcome, and a probe that checked nothing fails."""

from __future__ import annotations

import os
import sys
import types

import pytest

from k3patch.probekit import Checks, Swap


class Holder:
    inherited = "base"


class Child(Holder):
    own = 1


def test_swaps_are_undone_even_when_the_probe_raises(monkeypatch):
    monkeypatch.setenv("K3_PROBEKIT_SET", "before")
    monkeypatch.delenv("K3_PROBEKIT_UNSET", raising=False)
    real = sys.modules["os"]
    with pytest.raises(RuntimeError), Swap() as swap:
        swap.env("K3_PROBEKIT_SET", None)
        swap.env("K3_PROBEKIT_UNSET", "x")
        swap.attr(Child, "own", 2)
        swap.attr(Child, "inherited", "mine")
        swap.attr(Child, "brand_new", True)
        fake = swap.module("os", types.ModuleType("os"))
        swap.module("k3patch_probekit_fake")
        assert sys.modules["os"] is fake and os.environ.get("K3_PROBEKIT_UNSET") == "x"
        raise RuntimeError("probe failed half way")
    assert os.environ["K3_PROBEKIT_SET"] == "before"
    assert "K3_PROBEKIT_UNSET" not in os.environ
    assert Child.own == 1 and Child.inherited == "base" and "inherited" not in vars(Child)
    assert not hasattr(Child, "brand_new")
    assert sys.modules["os"] is real and "k3patch_probekit_fake" not in sys.modules


def test_checks_become_one_outcome():
    checks = Checks("table")
    checks.expect("a", got=1, want=1)
    assert checks.outcome().ok and "2" not in checks.outcome().summary
    checks.expect("b", got=True, want=False)
    outcome = checks.outcome()
    assert not outcome.ok
    assert "b -> True: expected False" in outcome.summary
    assert len(outcome.checks) == 2


def test_a_probe_that_checked_nothing_fails():
    outcome = Checks("nothing").outcome()
    assert not outcome.ok and "no check ran" in outcome.summary


def test_notes_are_reported_but_are_no_checks():
    checks = Checks("gate")
    checks.note("caller: absent, nothing to check")
    assert not checks.outcome().ok, "a note alone must not pass"
    checks.check("static", True, "0 outside")
    outcome = checks.outcome(holds="no sync reachable")
    assert (outcome.ok, outcome.summary) == (True, "no sync reachable")
    assert outcome.checks == ("caller: absent, nothing to check", "static: ok (0 outside)")
    checks.check("traced", False, "2 syncs")
    assert checks.outcome(holds="unused").summary == "gate broken: traced: 2 syncs"
