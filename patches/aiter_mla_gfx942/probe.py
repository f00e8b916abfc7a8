"""aiter-mla-gfx942's probe, in the verify child on the real module, no GPU needed: a stand-in
`vllm.platforms.rocm` holds the tree's own GPU helpers (`_ON_*`, `on_*`) computed for a GPU the
probe picks, so a fix that asks any of them sees one consistent GPU.

Every expected value comes from SITES.md section 4's rule (`expected`), never from running the
code. FLAG_ROWS stand the two flags in directly, every combination with the variable and the GPU
(so a flag may differ from the variable: the flag decides); VARIABLE_ROWS set only the variables
and let the tree's `refresh_env_variables()` derive the flags (`=0` is "off" on every GPU, `true`
is an explicit "on" as `1` is). The unpatched code fails one row of each table (unset on gfx942,
both flags on); every other row is there to kill a wrong fix.
"""

from __future__ import annotations

import ast
import itertools
from typing import Any

from k3patch.patch import ProbeOutcome
from k3patch.probekit import Checks, Stub, Swap, attempt, package_dir

VARIABLE = "VLLM_ROCM_USE_AITER_MLA"
AITER_VARIABLE = "VLLM_ROCM_USE_AITER"
# The arch names ROCm reports; gfx90a (MI200) is a gfx9 that is neither MI300 nor MI350.
GPUS = {gpu: f"{gpu}:sramecc+:xnack-" for gpu in ("gfx942", "gfx950", "gfx90a")}
# None: unset. Every spelling vLLM's envs.py takes: it reads the variable as
# `os.getenv(NAME, "True").lower() in ("true", "1")` and `envs.is_set(NAME)` as `NAME in
# os.environ`, so any value is "set", and only the cases of "true" and "1" turn the flag on.
VALUES: tuple[str | None, ...] = (
    *(None, "0", "1", "true", "True", "TRUE", "tRuE", "false", "False", "FALSE"),
    *("", "yes", "on", "off", "2", " 1"),
)
AITER_VALUES = ("1", "0", "True", "false")


def expected(variable: str | None, gpu: str, aiter: bool, mla: bool) -> bool:
    """SITES.md section 4: both flags on, and the variable set or a GPU other than gfx942."""
    return aiter and mla and (variable is not None or gpu != "gfx942")


def parsed_mla_flag(variable: str | None) -> bool:
    """`_MLA_ENABLED` as vLLM reads it from the variable: on when unset, else on exactly for
    the cases of "true" and "1"."""
    return variable is None or variable.lower() in ("1", "true")


def parsed_aiter_flag(variable: str) -> bool:
    """`_AITER_ENABLED` as vLLM reads VLLM_ROCM_USE_AITER (default off)."""
    return variable.lower() in ("1", "true")


# (variable, GPU, AITER flag, MLA flag, expected)
FLAG_ROWS = tuple(
    (variable, gpu, aiter, mla, expected(variable, gpu, aiter, mla))
    for variable, gpu, aiter, mla in itertools.product(VALUES, GPUS, (True, False), (True, False))
)
# (VLLM_ROCM_USE_AITER, VLLM_ROCM_USE_AITER_MLA, GPU, expected)
VARIABLE_ROWS = tuple(
    (
        aiter,
        variable,
        gpu,
        expected(variable, gpu, parsed_aiter_flag(aiter), parsed_mla_flag(variable)),
    )
    for aiter, variable, gpu in itertools.product(AITER_VALUES, VALUES, GPUS)
)


def shown(variable: str | None) -> str:
    return "unset" if variable is None else repr(variable)


def flag_case(variable: str | None, gpu: str, aiter: bool, mla: bool) -> str:
    case = f"{VARIABLE}={shown(variable)} {gpu} aiter={aiter:d} mla={mla:d}"
    return case + (" (flag differs from the variable)" if mla != parsed_mla_flag(variable) else "")


def variable_case(aiter_variable: str, variable: str | None, gpu: str) -> str:
    head = f"from the variables: {AITER_VARIABLE}={aiter_variable}"
    return f"{head} {VARIABLE}={shown(variable)} {gpu}"


def probe_truth_table() -> ProbeOutcome:
    from vllm._aiter_ops import rocm_aiter_ops  # type: ignore[import-not-found]

    # `if_aiter_supported` returns None off ROCm; the probe calls the function it wraps.
    raw = rocm_aiter_ops.__dict__["is_mla_enabled"].__func__
    func = getattr(raw, "__wrapped__", raw)
    checks = Checks("truth table")
    with Swap() as swap:
        fake_rocm = swap.module("vllm.platforms.rocm")
        helpers = _gpu_helpers()
        # refresh_env_variables() rewrites every flag of the class; the Swap puts each back.
        for name, value in list(vars(rocm_aiter_ops).items()):
            if name.startswith("_") and not name.startswith("__") and not callable(value):
                swap.attr(rocm_aiter_ops, name, value)
        for variable, gpu, aiter, mla, want in FLAG_ROWS:
            vars(fake_rocm).update(helpers[gpu])
            swap.env(VARIABLE, variable)
            swap.attr(rocm_aiter_ops, "_AITER_ENABLED", aiter)
            swap.attr(rocm_aiter_ops, "_MLA_ENABLED", mla)
            case = flag_case(variable, gpu, aiter, mla)
            checks.expect(case, got=_answer(func, rocm_aiter_ops), want=want)
        _check_parsing(checks, swap)
        for aiter_variable, variable, gpu, want in VARIABLE_ROWS:
            vars(fake_rocm).update(helpers[gpu])
            swap.env(AITER_VARIABLE, aiter_variable)
            swap.env(VARIABLE, variable)
            rocm_aiter_ops.refresh_env_variables()
            case = variable_case(aiter_variable, variable, gpu)
            checks.expect(case, got=_answer(func, rocm_aiter_ops), want=want)
    return checks.outcome()


def _check_parsing(checks: Checks, swap: Swap) -> None:
    """The tree's own envs.py reads every spelling as the rows assume (else the rows' expected
    values are not this release's)."""
    from vllm import envs  # type: ignore[import-not-found]

    parse = getattr(envs, "environment_variables", {}).get(VARIABLE)
    if parse is None:
        checks.note(f"envs.py has no parser for {VARIABLE}; the rows use SITES.md's rule")
        return
    differ = []
    for variable in VALUES:
        swap.env(VARIABLE, variable)
        if bool(parse()) != parsed_mla_flag(variable) or envs.is_set(VARIABLE) != (
            variable is not None
        ):
            differ.append(shown(variable))
    line = f"envs.py reads {VARIABLE} as the rows assume for {len(VALUES)} spellings"
    checks.check(line, not differ, f"it differs for {', '.join(differ)}" if differ else "")


def _answer(func: Any, ops: Any) -> bool | str:
    """The method's answer, or what it raised (a failed row, not a failed probe)."""
    answer, error = attempt(func, ops)
    return bool(answer) if error is None else f"raised {error}"


def _gpu_helpers() -> dict[str, dict[str, Any]]:
    """Per GPU, rocm.py's own `_ON_*` assignments and `on_*` functions (decorators such as
    `functools.cache` dropped) run for its arch, read from torch or from `_GCN_ARCH`."""
    vllm_dir = package_dir("vllm")
    if vllm_dir is None:
        raise RuntimeError("vllm is not importable as a package")
    tree = ast.parse((vllm_dir / "platforms" / "rocm.py").read_text(encoding="utf-8"))
    body: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("on_"):
            node.decorator_list = []
            body.append(node)
        elif isinstance(node, ast.Assign) and all(
            isinstance(t, ast.Name) and t.id.startswith("_ON_") for t in node.targets
        ):
            body.append(node)
    code = compile(ast.Module(body=body, type_ignores=[]), "vllm/platforms/rocm.py", "exec")

    helpers = {}
    for gpu, arch in GPUS.items():
        device = Stub(gcnArchName=arch)
        torch = Stub(cuda=Stub(get_device_properties=lambda *a, device=device, **k: device))
        names: dict[str, Any] = {"_GCN_ARCH": arch, "torch": torch}
        exec(code, names)
        helpers[gpu] = {k: v for k, v in names.items() if k.startswith(("on_", "_ON_"))}
    return helpers
