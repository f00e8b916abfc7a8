"""`verify`: import what the patches touch with the tree's own interpreter, and run each patch's
behaviour probe against the real patched code. An import failure is judged by evidence, in this
order: a syntax error in a patched file is the patch's; else the original text of the patched
files (from the state record, imported through an overlay) decides: it imports, the patch broke
it; it fails too, the environment blocks it (no GPU, a missing optional dependency); with no
original, a failure raised inside a patched file is the patch's, any other the environment's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k3patch import _verify_child
from k3patch.errors import EnvironmentProblem, VerifyError
from k3patch.patch import Patch
from k3patch.plaintext import whole
from k3patch.registry import all_patches, patches_dir
from k3patch.scan import Report, scan
from k3patch.state import load_or_none
from k3patch.transaction import Transaction
from k3patch.tree import VllmTree
from k3patch.verdicts import Verdict

IMPORT_OK = "ok"
BROKEN = "broken by the patch"
BLOCKED = "blocked by the environment"


@dataclass
class ModuleCheck:
    module: str
    status: str  # IMPORT_OK, BROKEN or BLOCKED
    reason: str = ""
    decided_by: str = ""


@dataclass
class PatchCheck:
    patch_id: str
    verdict: Verdict
    modules: list[ModuleCheck] = field(default_factory=list)
    probe_ok: bool | None = None  # None: not run
    probe_summary: str = ""
    probe_checks: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        broken = any(m.status == BROKEN for m in self.modules)
        return self.verdict.is_good and not broken and self.probe_ok is not False

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.patch_id,
            "verdict": self.verdict.value,
            "ok": self.ok,
            "modules": [asdict(m) for m in self.modules],
            "probe": {
                "ran": self.probe_ok is not None,
                "ok": self.probe_ok,
                "summary": self.probe_summary,
                "checks": self.probe_checks,
            },
        }


@dataclass
class VerifyReport:
    report: Report
    python: str
    python_version: str
    patches: list[PatchCheck]
    extra: list[ModuleCheck] = field(default_factory=list)  # --module: imported, not judged

    @property
    def ok(self) -> bool:
        """Every patch good and every module imported, in a tree no interrupted run left: its
        files are not a committed state (its next apply or revert rolls them back)."""
        return (
            self.report.interrupted is None
            and all(p.ok for p in self.patches)
            and all(m.status != BROKEN for m in self.extra)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "python": self.python,
            "python_version": self.python_version,
            "ok": self.ok,
            "patches": [p.to_json() for p in self.patches],
            "modules": [asdict(m) for m in self.extra],
        }


def tree_python(tree: VllmTree) -> str:
    """The interpreter that owns the tree: the venv or prefix around a site-packages dir,
    else the running one."""
    root = tree.root
    if tree.kind == "site-packages" and root.parent.name.startswith("python"):
        bin_dir = str(root.parent.parent.parent / "bin")  # <prefix>/lib/pythonX.Y/site-packages
        for name in (root.parent.name, "python3", "python"):
            if found := shutil.which(name, path=bin_dir):
                return found
    return sys.executable


def _run_child(python: str, tree: VllmTree, args: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree.root), *filter(None, [env.get("PYTHONPATH")])])
    # Verifying must not change the tree: no pycs written next to the patched sources.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        with _terminated_as_an_exception():
            proc = subprocess.run(
                [python, _verify_child.__file__, json.dumps(args)],
                capture_output=True,
                # A module may print anything while it imports: odd bytes are shown, never fatal.
                encoding="utf-8",
                errors="replace",
                env=env,
                cwd=tempfile.gettempdir(),
                timeout=600,
            )
    except FileNotFoundError:
        raise VerifyError(f"{python}: no such interpreter; pass --python PATH") from None
    except subprocess.TimeoutExpired:
        raise VerifyError(f"importing the patched modules with {python} took over 600 s") from None
    except _Terminated:
        # subprocess.run killed the child on the way out; now end as SIGTERM would have.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_verify_child.MARKER):
            try:
                result = json.loads(line[len(_verify_child.MARKER) :])
            except ValueError as exc:
                raise _not_a_result(python, f"text that is not JSON ({exc})") from None
            return _checked(result, python, args)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise VerifyError(f"the verify child under {python} exited {proc.returncode}: {tail[0]}")


class _Terminated(BaseException):
    """SIGTERM arrived while the verify child ran."""


@contextlib.contextmanager
def _terminated_as_an_exception() -> Iterator[None]:
    """SIGTERM (docker stop, a job's time limit) raises inside the block, so that the child
    is killed with its parent instead of running on (SIGINT does the same by KeyboardInterrupt).
    Outside the main thread no handler can be set: the signal then acts as it always does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, frame: object) -> None:
        raise _Terminated

    before = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _not_a_result(python: str, what: str) -> VerifyError:
    return VerifyError(
        f"the verify child under {python} printed {what}, not a verify result; nothing was "
        "verified (is it the interpreter that runs vLLM?)"
    )


def _checked(result: object, python: str, args: dict[str, Any]) -> dict[str, Any]:
    """The child's result, if it is the object verify reads: an import result for every module
    asked for, a well-formed probe result for any probe. Anything else is exit 3 naming the
    interpreter, never a KeyError read as k3patch's bug or, worse, a pass."""
    if not isinstance(result, dict):
        raise _not_a_result(python, f"a JSON {type(result).__name__}")
    imports, probes = result.get("imports"), result.get("probes")
    if not isinstance(imports, dict) or not isinstance(probes, dict):
        raise _not_a_result(python, "an object without its imports and probes")
    if not isinstance(result.get("python", ""), str):
        raise _not_a_result(python, "an object whose python version is not text")
    for name in args["modules"]:
        got = imports.get(name)
        if not isinstance(got, dict) or not isinstance(got.get("ok"), bool):
            raise _not_a_result(python, f"no import result for {name}")
        texts = (got.get("type"), got.get("message"), got.get("raised_in", ""))
        if not got["ok"] and not all(isinstance(text, str) for text in texts):
            raise _not_a_result(python, f"a malformed import failure for {name}")
    for patch_id, probe in probes.items():
        checks = probe.get("checks", []) if isinstance(probe, dict) else None
        if not (
            isinstance(probe, dict)
            and isinstance(probe.get("ok"), bool)
            and isinstance(probe.get("summary"), str)
            and isinstance(checks, list)
            and all(isinstance(c, str) for c in checks)
        ):
            raise _not_a_result(python, f"a malformed probe result for {patch_id}")
    return result


def verify(
    tree: VllmTree,
    patches: tuple[Patch, ...] | None = None,
    *,
    python: str | None = None,
    extra_modules: tuple[str, ...] = (),
    progress: Callable[[str], None] | None = None,
) -> VerifyReport:
    """`progress` is told, before the child starts (it takes seconds: it imports torch), which
    interpreter imports how many modules and runs how many probes."""
    patches = all_patches() if patches is None else patches
    report = scan(tree, patches, use_record=False)
    if report.state_problem:  # k3patch's own state unusable: never "verified" (as apply: 3)
        raise EnvironmentProblem(report.state_problem)
    if python and os.sep in python:
        python = os.path.abspath(python)  # the child runs from a temp dir
    elif python:
        python = shutil.which(python) or python
    chosen = "given by --python" if python else "the tree's own interpreter, found beside it"
    if not python and tree_python(tree) == sys.executable:
        chosen = "k3patch's own interpreter: none was found beside the tree"
    python = python or tree_python(tree)
    _check_interpreter(python)
    verdicts = report.verdicts()
    live = [p for p in patches if verdicts[p.id] in (Verdict.APPLIED, Verdict.SATISFIED)]
    modules = list(dict.fromkeys([m for p in live for m in p.modules] + list(extra_modules)))

    args = {
        # The child imports k3patch's standard-library modules and the patch packages from
        # these directories (k3patch itself is not installed in the tree's interpreter).
        "package_dir": os.path.dirname(os.path.abspath(__file__)),
        "patches_dir": str(patches_dir()),
        "patch_modules": {p.id: type(p).__module__ for p in patches},
        "modules": modules,
        "probes": [p.id for p in live],
        "probe_modules": {p.id: list(p.modules) for p in live},
    }
    if progress is not None and (modules or live):
        progress(
            f"verify: importing {len(modules)} module(s) and running {len(live)} probe(s) with "
            f"{whole(python)} ({chosen})"
        )
    result = _run_child(python, tree, args) if modules or live else {"imports": {}, "probes": {}}
    # Real paths of the files that hold a site in k3patch's shape.
    applied = (r.file for r in report.results if r.verdict is Verdict.APPLIED)
    patched_files = {os.path.realpath(tree.path(rel)) for rel in applied}
    failed = [m for m, r in result["imports"].items() if not r["ok"]]
    original_imports = _import_originals(python, tree, failed, patched_files)

    def judged(name: str) -> ModuleCheck:
        return _judge(name, result["imports"][name], patched_files, original_imports)

    checks = []
    for patch in patches:
        wanted = patch.modules if patch in live else ()
        check = PatchCheck(patch.id, verdicts[patch.id], [judged(name) for name in wanted])
        probe = result["probes"].get(patch.id)
        if probe is not None:
            check.probe_ok = probe["ok"]
            check.probe_summary = probe["summary"]
            check.probe_checks = probe.get("checks", [])
        elif patch in live and any(m.status != IMPORT_OK for m in check.modules):
            check.probe_summary = "not run: its module did not import"
        checks.append(check)
    extra = [judged(name) for name in extra_modules]
    verified = VerifyReport(report, python, result.get("python", ""), checks, extra)
    _refuse_vacuous(verified, patches, chosen)
    return verified


def _refuse_vacuous(verified: VerifyReport, patches: tuple[Patch, ...], chosen: str) -> None:
    """A pass that checked nothing is not a pass: the Dockerfile's `&& k3patch verify` must not
    go green because this interpreter lacks torch or vLLM's dependencies."""
    if not verified.ok:
        return  # a real failure is reported as one (exit 1)
    own_probe = {p.id for p in patches if type(p).probe is not Patch.probe}
    lacking = [
        f"{c.patch_id}'s probe did not run ({c.probe_summary or 'no result'})"
        for c in verified.patches
        if c.verdict in (Verdict.APPLIED, Verdict.SATISFIED)
        and c.patch_id in own_probe
        and c.probe_ok is None
    ]
    modules = [m for c in verified.patches for m in c.modules]
    if modules and not any(m.status == IMPORT_OK for m in modules):
        first = modules[0]
        lacking.insert(0, f"no selected module imported (e.g. {first.module}: {first.reason})")
    if not modules and not verified.extra and all(c.probe_ok is None for c in verified.patches):
        # No patch selected (`--only X --skip X`), or each one not applicable here: nothing
        # was imported and no probe ran.
        names = ", ".join(f"{c.patch_id} {c.verdict.value}" for c in verified.patches)
        raise VerifyError(
            "nothing to verify: "
            + (
                f"no selected patch has a module to import or a probe to run here ({names})"
                if names
                else "--only and --skip leave no patch selected"
            )
        )
    if lacking:
        raise VerifyError(
            f"nothing was verified with {verified.python} ({chosen}): "
            + "; ".join(lacking)
            + ". Pass --python with the interpreter that runs vLLM (torch and vLLM's "
            "dependencies installed)"
        )


def _check_interpreter(python: str) -> None:
    """An unusable --python is the environment's problem (exit 3), said before anything runs."""
    if os.path.isdir(python):
        raise VerifyError(f"--python {python}: a directory, not an interpreter")
    if os.path.exists(python) and not os.access(python, os.X_OK):
        raise VerifyError(f"--python {python}: not executable; pass the interpreter that runs vLLM")


def _import_originals(
    python: str, tree: VllmTree, failed: list[str], patched_files: set[str]
) -> dict[str, Any] | None:
    """Import the failed modules again from the original text of every patched file."""
    record = load_or_none(tree.state_dir)
    if not failed or not patched_files or record is None:
        return None
    txn = Transaction(tree.package_dir)
    with tempfile.TemporaryDirectory(prefix="k3patch-verify-") as tmp:
        overlay = {}
        for rel, fs in record.files.items():
            path = os.path.realpath(tree.path(rel))
            if fs.original is None or path not in patched_files:
                continue
            copy = Path(tmp) / rel.replace("/", "__")
            copy.write_bytes(txn.blobs.load(fs.original))
            overlay[path] = str(copy)
        if not overlay:
            return None
        result = _run_child(python, tree, {"modules": failed, "overlay": overlay})
        imports: dict[str, Any] = result["imports"]
        return imports


def _judge(
    name: str,
    got: dict[str, Any],
    patched_files: set[str],
    original_imports: dict[str, Any] | None,
) -> ModuleCheck:
    if got["ok"]:
        return ModuleCheck(name, IMPORT_OK)
    reason = f"{got['type']}: {got['message']}"
    in_patched = got.get("raised_in", "") in patched_files
    original = (original_imports or {}).get(name)
    if got["type"] in ("SyntaxError", "IndentationError", "TabError") and in_patched:
        return ModuleCheck(name, BROKEN, reason, "the error is a syntax error in a patched file")
    if original is not None and original["ok"]:
        return ModuleCheck(name, BROKEN, reason, "the original files import; the patched fail")
    if original is not None:
        why = f"the original files fail too ({original['type']}: {original['message']})"
        return ModuleCheck(name, BLOCKED, reason, why)
    if in_patched:
        return ModuleCheck(name, BROKEN, reason, "the failure is raised inside a patched file")
    why = "the failure is raised outside the patched files (no original to compare against)"
    return ModuleCheck(name, BLOCKED, reason, why)
