"""Stale bytecode in every invalidation mode: after apply (and after revert) each pyc of a changed
file holds the code of the new source, in the mode it had; a pyc of another interpreter is
removed. Checked by loading the code object from the pyc itself, as the interpreter would."""

from __future__ import annotations

import importlib.util
import marshal
import py_compile
import sys
import types

import pytest
from conftest import run_cli, slow_after

pytestmark = pytest.mark.wheel
MODES = {
    "timestamp": (py_compile.PycInvalidationMode.TIMESTAMP, 0),
    "checked-hash": (py_compile.PycInvalidationMode.CHECKED_HASH, 3),
    "unchecked-hash": (py_compile.PycInvalidationMode.UNCHECKED_HASH, 1),
}


def names_in(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out |= names_in(const)
    return out


def pyc_code(path) -> tuple[int, types.CodeType]:
    data = path.read_bytes()
    assert data[:4] == importlib.util.MAGIC_NUMBER
    return int.from_bytes(data[4:8], "little"), marshal.loads(data[16:])


@pytest.mark.parametrize("mode", slow_after(list(MODES)))
@pytest.mark.parametrize("optimize", slow_after([0, 1]))
def test_pycs_follow_apply_and_revert_in_their_mode(make_tree, mode, optimize):
    site = make_tree("0.31.0")
    source = site / "vllm" / "_aiter_ops.py"
    pyc = importlib.util.cache_from_source(str(source), optimization=optimize or "")
    invalidation, flags = MODES[mode]
    py_compile.compile(str(source), cfile=pyc, optimize=optimize, invalidation_mode=invalidation)
    from pathlib import Path

    pyc = Path(pyc)
    assert "is_set" not in names_in(pyc_code(pyc)[1])

    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    got_flags, code = pyc_code(pyc)
    assert got_flags == flags, "the invalidation mode changed"
    assert "is_set" in names_in(code), "the pyc still holds the old code"

    assert run_cli("revert", "--vllm", str(site)).returncode == 0
    got_flags, code = pyc_code(pyc)
    assert got_flags == flags
    assert "is_set" not in names_in(code), "after revert the pyc still holds the patched code"


def test_foreign_interpreter_pyc_is_removed(make_tree):
    site = make_tree("0.31.0")
    cache = site / "vllm" / "__pycache__"
    cache.mkdir()
    other_tag = "cpython-399" if sys.implementation.cache_tag != "cpython-399" else "cpython-398"
    foreign = cache / f"_aiter_ops.{other_tag}.pyc"
    foreign.write_bytes(b"\x00\x00\r\n" + b"\x01\x00\x00\x00" + b"\x00" * 8 + b"stale")
    unrelated = cache / f"envs.{sys.implementation.cache_tag}.pyc"
    unrelated.write_bytes(b"untouched")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    assert not foreign.exists()
    assert unrelated.read_bytes() == b"untouched"
