"""kda-gather-diagnostic on a real GPU: the fixtures' gather_initial_states (Triton kernel and
all) and the inlining callers, before and after `k3patch apply`, on CUDA tensors.

With `torch.cuda.set_sync_debug_mode("error")` and K3_KDA_GATHER_LOG unset, the fork's code
raises (it syncs) and the patched code does not; with K3_KDA_GATHER_LOG=1 the diagnostic still
logs the out-of-range index; the outputs are bit-identical everywhere. Skipped without CUDA and
Triton (CI has neither); run on the device machine:

    python -m pytest tests/test_kda_gather_diagnostic_gpu.py -v

Set K3PATCH_KDA_GPU_REPORT=path.json to keep what was observed (benchmarks/KDA_RESULTS.md).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run it on the device machine)", allow_module_level=True)

from conftest import FIXTURES, run_cli  # noqa: E402

ENV = "K3_KDA_GATHER_LOG"
OPS_MODULE = "vllm.model_executor.layers.mamba.ops.gather_initial_states"
REPORT: dict[str, dict] = {}

# (fixture, does the fork's code sync with the variable unset)
OPS_FIXTURES = [
    ("kda-fork-folded", True),
    ("kda-fork-guard-script", True),
    ("kda-legacy-nosync", False),  # the older script already gated it: apply changes nothing
]


@contextmanager
def vllm_from(root: Path) -> Iterator[None]:
    """Import `vllm` from one fixture tree only (each tree is its own `vllm` package)."""

    def purge() -> None:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]

    purge()
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path.remove(str(root))
        purge()


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> dict[str, dict[str, Path]]:
    out = {}
    for name in [f for f, _ in OPS_FIXTURES] + ["kda-inlined-caller"]:
        base = tmp_path_factory.mktemp(name)
        before, after = base / "before", base / "after"
        shutil.copytree(FIXTURES / name, before)
        shutil.copytree(FIXTURES / name, after)
        proc = run_cli("apply", "--vllm", str(after), "--only", "kda-gather-diagnostic")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out[name] = {"before": before, "after": after}
    return out


@pytest.fixture(scope="module", autouse=True)
def keep_report() -> Iterator[None]:
    yield
    path = os.environ.get("K3PATCH_KDA_GPU_REPORT")
    if path:
        report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **REPORT}
        Path(path).write_text(json.dumps(report, indent=2, sort_keys=True))


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def observe(call: Callable[[], torch.Tensor]) -> dict:
    """Run `call` three ways: variable unset under sync-debug "error", unset with syncs allowed,
    and =1; return whether the first raised, every output, and what was logged."""
    handler = Captured()
    logging.getLogger("vllm").addHandler(handler)
    saved = os.environ.pop(ENV, None)
    outputs: dict[str, torch.Tensor] = {}
    raised = ""
    try:
        call()  # compile the Triton kernel before anything is measured
        torch.cuda.synchronize()
        handler.messages.clear()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outputs["unset, sync-debug error"] = call()
        except RuntimeError as exc:
            raised = str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        outputs["unset"] = call()
        torch.cuda.synchronize()
        quiet = list(handler.messages)
        handler.messages.clear()
        os.environ[ENV] = "1"
        outputs["K3_KDA_GATHER_LOG=1"] = call()
        torch.cuda.synchronize()
        logged = list(handler.messages)
    finally:
        logging.getLogger("vllm").removeHandler(handler)
        os.environ.pop(ENV, None)
        if saved is not None:
            os.environ[ENV] = saved
    return {"raised": raised, "outputs": outputs, "logged_unset": quiet, "logged_on": logged}


def cuda_inputs(pool: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    state = torch.randn((pool, 4, 16, 32), device="cuda", generator=gen)
    # 70 and -2 are out of range; -2 sits where there is no initial state (a padded slot).
    indices = torch.tensor([3, 70, 5, -2, 63, 0], dtype=torch.int32, device="cuda")
    has = torch.tensor([True, True, False, False, True, True], device="cuda")
    return state, indices, has


def expected_rows(state: torch.Tensor, indices: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    rows = state[indices.long().clamp(0, state.shape[0] - 1)]
    return torch.where(has.view(-1, 1, 1, 1), rows, torch.zeros_like(rows))


def summarise(case: str, got: dict, reference: torch.Tensor) -> dict:
    same = {k: bool(torch.equal(v, reference)) for k, v in got["outputs"].items()}
    REPORT[case] = {
        "raised_under_sync_debug_error": got["raised"] or None,
        "outputs_equal_reference": same,
        "warnings_with_variable_unset": got["logged_unset"],
        "warnings_with_variable_1": got["logged_on"],
    }
    return same


@pytest.mark.parametrize("fixture,fork_syncs", OPS_FIXTURES)
@pytest.mark.parametrize("side", ["before", "after"])
def test_gather_initial_states_on_cuda(trees, fixture, fork_syncs, side):
    state, indices, has = cuda_inputs()
    with vllm_from(trees[fixture][side]):
        from vllm.model_executor.layers.mamba.ops.gather_initial_states import (
            gather_initial_states,
        )

        got = observe(lambda: gather_initial_states(state, indices, has))
    same = summarise(
        f"{fixture} {side} apply: gather_initial_states", got, expected_rows(state, indices, has)
    )
    syncs = fork_syncs and side == "before"
    if syncs:
        assert "synchronizing" in got["raised"], got["raised"]
        assert set(got["outputs"]) == {"unset", "K3_KDA_GATHER_LOG=1"}
    else:
        assert got["raised"] == ""
        assert set(got["outputs"]) == {"unset, sync-debug error", "unset", "K3_KDA_GATHER_LOG=1"}
        # Only the gated form is silent with the variable unset.
        assert got["logged_unset"] == []
    assert all(same.values()), same
    assert any("70" in m for m in got["logged_on"]), got["logged_on"]


@pytest.mark.parametrize("side", ["before", "after"])
def test_inlined_callers_on_cuda(trees, side):
    state, indices, has = cuda_inputs()
    q = torch.randn((8, 16), device="cuda")
    with vllm_from(trees["kda-inlined-caller"][side]):
        from vllm.models.kimi_k3.amd.kda import KimiK3DeltaAttention
        from vllm.models.kimi_k3.amd.ops.kda_prefill import chunk_kda_prefill

        layer = KimiK3DeltaAttention()
        prefill = observe(
            lambda: chunk_kda_prefill(
                q, state_cache=state, state_indices=indices, has_initial_state=has
            )[1]
        )
        forward = observe(lambda: layer._forward(q, state, indices, has))
    reference = expected_rows(state, indices, has)
    for name, got in (("chunk_kda_prefill", prefill), ("KimiK3DeltaAttention._forward", forward)):
        same = summarise(f"kda-inlined-caller {side} apply: {name}", got, reference)
        if side == "before":
            assert "synchronizing" in got["raised"], (name, got["raised"])
        else:
            assert got["raised"] == "", name
            assert got["logged_unset"] == [], name
        assert all(same.values()), (name, same)
        assert any("70" in m for m in got["logged_on"]), (name, got["logged_on"])
