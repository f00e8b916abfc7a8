"""The probe kit: every stand-in is undone, also when the probe raises; checks become one
outcome, and a probe that checked nothing fails."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from k3patch import probekit
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


def test_failures_count_before_no_check_and_templates_shape_the_summary():
    checks = Checks("drive")
    checks.fail("case 1: cannot drive this tree")
    assert checks.outcome(broken="{failures}").summary == "case 1: cannot drive this tree"
    checks = Checks("gate")
    checks.record("step 1: held", ok=True)
    checks.record("step 2: sent early", ok=False)
    checks.record("step 3: line", ok=False, failure="step 3 in other words")
    outcome = checks.outcome(broken="wrong in {failed} of {ran} checks: {failures}")
    assert outcome.summary == "wrong in 2 of 3 checks: step 2: sent early; step 3 in other words"
    assert outcome.checks == ("step 1: held", "step 2: sent early", "step 3: line")
    passing = Checks("gate")
    passing.record("step 1: sent")
    assert passing.outcome(holds="sent once ({ran} checks)").summary == "sent once (1 checks)"


class Real:
    def __init__(self) -> None:
        raise AssertionError("needs a GPU")


def test_stand_ins_hold_what_they_are_given():
    import weakref

    obj = probekit.stand_in(Real, mode="write", maps={})
    assert isinstance(obj, Real) and (obj.mode, obj.maps) == ("write", {})
    a, b = probekit.Stub(x=1), probekit.Stub(x=1)
    assert a != b and a == a and len({a, b}) == 2, "compared and hashed by identity"
    assert weakref.ref(a)() is a and not hasattr(a, "y")
    sink = probekit.Always("socket")
    assert "any path" in sink and sink["any path"] == "socket"


def test_call_accepted_drops_what_the_signature_does_not_take():
    def old_release(block_size, dtype="auto"):
        return (block_size, dtype)

    assert probekit.call_accepted(old_release, block_size=16, num_kv_heads=1) == (16, "auto")
    assert probekit.call_accepted(Holder) is not None


def worker_init(self, config, role):  # a function whose middle stretch is run alone
    import nothing_here  # noqa: F401  (needs what the probe lacks)

    self.maps = {name: role for name in config}
    self.count = len(self.maps)
    raise AssertionError("the rest needs a network")


def test_source_of_keeps_file_lines_and_run_statements_runs_a_stretch():
    node = probekit.source_of(worker_init)
    assert node is not None and node.name == "worker_init"
    assert node.body[1].lineno == worker_init.__code__.co_firstlineno + 3
    holder = types.SimpleNamespace()
    probekit.run_statements(worker_init, node.body[1:3], holder, ["a", "b"], "prefill")
    assert holder.maps == {"a": "prefill", "b": "prefill"} and holder.count == 2
    assert probekit.source_of(len) is None
    with pytest.raises(ZeroDivisionError) as raised:
        probekit.run_statements(worker_init, ast.parse("1 / 0").body, holder, [], "")
    frame = raised.traceback[-1]
    assert frame.path == Path(__file__), "tracebacks point into the function's own file"


def test_on_exit_calls_run_in_turn_with_the_other_undos_also_when_the_probe_raises():
    state = {"role": "consumer"}
    order: list[str] = []
    with pytest.raises(RuntimeError), Swap() as swap:
        swap.attr(Child, "own", 2)
        swap.on_exit(lambda role: (order.append("role"), state.update(role=role)), state["role"])
        swap.on_exit(order.append, "last in")
        state["role"] = "producer"
        raise RuntimeError("probe failed half way")
    assert state["role"] == "consumer" and Child.own == 1
    assert order == ["last in", "role"], "undone in reverse order"


def test_attempt_returns_the_result_or_the_exception_as_type_and_message():
    assert probekit.attempt(divmod, 7, 2) == ((3, 1), None)
    assert probekit.attempt(int, "x", base=10) == (
        None,
        "ValueError: invalid literal for int() with base 10: 'x'",
    )
    assert probekit.attempt(lambda: None) == (None, None), "a None result is no failure"
    with pytest.raises(KeyboardInterrupt):  # not an Exception: never turned into a report
        probekit.attempt(lambda: (_ for _ in ()).throw(KeyboardInterrupt))


def test_log_collects_records_at_the_level_and_puts_the_logger_back():
    logger = logging.getLogger("k3patch.test.quiet")
    logger.setLevel(logging.ERROR)
    before = list(logger.handlers)
    with pytest.raises(RuntimeError), Swap() as swap:
        records = swap.log("k3patch.test.quiet", logging.WARNING)
        logger.info("below the level")
        logger.warning("seen %d", 9)
        raise RuntimeError("probe failed half way")
    assert [r.getMessage() for r in records] == ["seen 9"]
    assert logger.level == logging.ERROR and logger.handlers == before
    logger.warning("after the swap")
    assert len(records) == 1


def test_package_dir_finds_a_package_without_importing_it(tmp_path, monkeypatch):
    (tmp_path / "k3pkg_probe").mkdir()
    (tmp_path / "k3pkg_probe" / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (tmp_path / "k3mod_probe.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert probekit.package_dir("k3pkg_probe") == tmp_path / "k3pkg_probe"
    assert "k3pkg_probe" not in sys.modules
    assert probekit.package_dir("k3mod_probe") is None, "a plain module is no package"
    assert probekit.package_dir("k3_no_such_package") is None


@pytest.mark.verify
def test_torch_trace_records_calls_and_aten_ops_except_while_paused(verify_python):
    script = textwrap.dedent(
        """
        import torch
        from k3patch.probekit import TorchTrace

        trace, t = TorchTrace(), torch.tensor([1, 2, 3])
        with trace:
            bool((t > 1).any())
            with trace.paused():
                t.sum()
        names = [name for name, _ in trace.calls]
        assert names[-2:] == ["any", "__bool__"] and "sum" not in names, names
        assert trace.calls[0][1][0] is t, "positional arguments are kept"
        assert any("_local_scalar_dense" in op for op in trace.aten), trace.aten
        assert not any("sum" in op for op in trace.aten), trace.aten
        with trace:
            pass
        assert trace.calls == [] and trace.aten == [], "restarted on entry"
        from k3patch.probekit import cuda_looking

        a, b = cuda_looking(t, t > 1)
        assert a.is_cuda and b.is_cuda and not t.is_cuda and b.dtype == torch.bool
        assert torch.equal(a.as_subclass(torch.Tensor), t)
        assert not a.as_subclass(torch.Tensor).is_cuda
        print("traced")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(probekit.__file__).parent.parent)}
    done = subprocess.run(
        [verify_python, "-c", script], capture_output=True, text=True, env=env, check=False
    )
    assert done.stdout.strip() == "traced", done.stderr


def test_calls_answer_and_keep_every_call_in_order():
    offsets = probekit.Calls(lambda layer, ids, **kw: list(ids))
    holder = probekit.Stub(compute=offsets)
    first = holder.compute("a", (1, 2), device="cpu")
    assert first == [1, 2] and holder.compute("b", ()) == []
    assert offsets.calls == [(("a", (1, 2)), {"device": "cpu"}, [1, 2]), (("b", ()), {}, [])]
    assert offsets.calls[0][2] is first, "the answer itself, so a caller can tell it by identity"
    assert probekit.stand_in(Real, compute=offsets).compute("c", [3]) == [3], "never bound"


def test_triton_on_host_stands_in_launched_kernels_and_missing_host_helpers():
    func = ast.parse(
        "def f(x):\n    grid = (triton.cdiv(8, 4),)\n    kernel[grid](x)\n"
        "    other[grid, 1](x)\n    table['k'][grid](x)\n    helper(x)\n"
    )
    calls: list[tuple] = []
    names = probekit.triton_on_host(func, {"triton": object()}, lambda *a: calls.append(a))
    assert set(names) == {"kernel", "other", "triton"}
    names["kernel"][(1,)](1, 2)
    assert calls == [(1, 2)]
    triton = names["triton"]
    assert [triton.next_power_of_2(n) for n in (0, 1, 5, 8)] == [1, 1, 8, 8]
    assert [triton.cdiv(a, b) for a, b in ((7, 2), (8, 4), (0, 3))] == [4, 2, 0]
    real = types.SimpleNamespace(next_power_of_2=None, cdiv=None)
    assert "triton" not in probekit.triton_on_host(func, {"triton": real}, print)


class Case(types.SimpleNamespace):
    def describe(self) -> str:
        return f"n={self.n}"


def test_seeded_names_each_seed_and_shrinks_the_first_failing_case():
    # Cases fail when n >= 5; the shrink halves n while it still fails.
    def wrongs(case: Case) -> tuple[list[str], str]:
        return ([f"n {case.n} too big"] if case.n >= 5 else []), f"n {case.n}"

    def shrink(case: Case, fails) -> Case:
        while fails(Case(n=case.n // 2)):
            case = Case(n=case.n // 2)
        return case

    checks = Checks("oracle")
    probekit.seeded(checks, "thing", [1, 40, 3, 22], lambda s: Case(n=s), wrongs, shrink)
    assert checks.lines == [
        "thing seed 1 (n 1): ok",
        "thing seed 40 (n 40): FAILED: n 40 too big",
        "thing seed 3 (n 3): ok",
        "thing seed 22 (n 22): FAILED: n 22 too big",
    ]
    assert checks.failures[-1] == "smallest failing thing of seed 40: n=5 -> n 5 too big"
    assert checks.failures[:2] == ["thing seed 40: n 40 too big", "thing seed 22: n 22 too big"]


def test_seeded_stops_at_a_tree_it_cannot_drive():
    def wrongs(case: Case) -> tuple[list[str], str]:
        raise KeyError("r0")

    checks = Checks("oracle")
    probekit.seeded(checks, "thing", [7, 8], lambda s: Case(n=s), wrongs, lambda c, f: c)
    assert checks.failures == ["thing seed 7: cannot drive this tree: KeyError('r0')"]
    assert checks.outcome().ok is False


def test_serve_answers_each_json_case_with_what_went_wrong():
    answers: list[str] = []
    lines = iter(['{"n": 9}\n', '{"n": 1}\n'])
    probekit.serve(
        lines, answers.append, lambda d: Case(**d), lambda c: ([f"n {c.n}"] * (c.n > 5), "")
    )
    assert answers == ['["n 9"]', "[]"]
