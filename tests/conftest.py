"""Shared test fixtures: real vLLM wheels, downloaded once and cached, and trees made from them.

Wheels come from the package registry with `pip download --no-deps vllm==X` into
$K3PATCH_WHEEL_CACHE (default ~/.cache/k3patch/wheels); the `.py` files and METADATA are
extracted once per version into a pristine cache beside it. Tests work on copies.
Nothing of vLLM is committed to this repository.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
CACHE = Path(os.environ.get("K3PATCH_WHEEL_CACHE", Path.home() / ".cache" / "k3patch" / "wheels"))
TREES = CACHE.parent / "trees"
SLOW = pytest.mark.slow

# Every vLLM release whose sites k3patch has read (shared/SITES.md), oldest first: what
# benchmarks/verdict_sweep.py and apply_sweep.py sweep, and what `verdict_sweep.py --newest`
# holds the registry's newest release against. A new release is added here (and, where its
# verdicts differ, to the tests' tables) once its verdicts are checked.
KNOWN_RELEASES = (
    "0.12.0 0.13.0 0.14.0 0.14.1 0.15.0 0.15.1 0.16.0 0.17.0 0.17.1 0.18.0 0.18.1 0.19.0 0.19.1 "
    "0.20.0 0.20.1 0.20.2 0.21.0 0.22.0 0.22.1 0.23.0 0.24.0 0.25.0 0.25.1 0.26.0 0.27.0 0.27.1 "
    "0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0 0.34.0"
).split()
NEWEST_RELEASE = KNOWN_RELEASES[-1]


@contextmanager
def _cache_lock() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def vllm_wheel(version: str) -> Path:
    """The cached wheel of vllm==version, downloaded on first use."""
    with _cache_lock():
        found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
        if not found:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--quiet",
                    f"vllm=={version}",
                    "-d",
                    str(CACHE),
                ],
                check=True,
            )
            found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
        assert found, f"pip download of vllm=={version} produced no wheel"
        return found[0]


def pristine_tree(version: str) -> Path:
    """A read-only cache of every .py file and the METADATA of the wheel (a site-packages dir)."""
    target = TREES / version
    done = target / ".complete"
    if done.exists():
        return target
    wheel = vllm_wheel(version)
    with _cache_lock():
        if done.exists():
            return target
        if target.exists():
            shutil.rmtree(target)
        with zipfile.ZipFile(wheel) as archive:
            names = [
                n
                for n in archive.namelist()
                if n.endswith(".py") or n.endswith(".dist-info/METADATA")
            ]
            archive.extractall(target, names)
        done.write_text("ok\n")
    return target


def _copy_minimal(src: Path, dst: Path, rels: list[str]) -> None:
    (dst / "vllm").mkdir(parents=True)
    for name in ("__init__.py", "envs.py"):
        shutil.copy2(src / "vllm" / name, dst / "vllm" / name)
    for rel in rels:
        source = src / "vllm" / rel
        if source.exists():
            (dst / "vllm" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dst / "vllm" / rel)
    for dist_info in src.glob("vllm-*.dist-info"):
        shutil.copytree(dist_info, dst / dist_info.name)


@pytest.fixture
def make_tree(tmp_path: Path) -> Callable[..., Path]:
    """make_tree("0.31.0") -> a writable site-packages dir holding a real vLLM tree.

    full=False copies only vllm/__init__.py, envs.py, the dist-info and every patch's target
    files (what the engine reads); full=True copies every .py file (for verify)."""
    return _copier(tmp_path, "site", pristine_tree)


def _copier(tmp_path: Path, prefix: str, cached: Callable[[str], Path]) -> Callable[..., Path]:
    """make(name, full=False): a writable copy of the cached tree `cached(name)`."""
    from k3patch.registry import all_patches
    from k3patch.scan import target_files

    counter = iter(range(1000))

    def make(name: str, full: bool = False) -> Path:
        src = cached(name)
        dst = tmp_path / f"{prefix}-{name}-{next(counter)}"
        if full:
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".complete"))
        else:
            _copy_minimal(src, dst, target_files(all_patches()))
        return dst

    return make


def _forktree_digest() -> str:
    """A hash of the builder's own source: a fork tree cached by other builder code is stale."""
    h = hashlib.sha256()
    for path in sorted((Path(__file__).parent / "forktree").glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def built_fork_tree(name: str) -> Path:
    """A read-only cache of fork tree `name` (tests/forktree): the real 0.28.0 wheel + the older
    scripts' site edits, built once per builder version."""
    import forktree

    target = TREES / f"fork-{name}-{_forktree_digest()}"
    done = target / ".complete"
    if done.exists():
        return target
    base = pristine_tree(forktree.BASE_VERSION)
    with _cache_lock():
        if done.exists():
            return target
        if target.exists():
            shutil.rmtree(target)
        forktree.build(name, base, target)
        done.write_text("ok\n")
    return target


@pytest.fixture
def fork_tree(tmp_path: Path) -> Callable[..., Path]:
    """fork_tree("a") -> a writable site-packages dir holding fork tree "a" (see tests/forktree).

    full=False copies only what the engine reads (as make_tree does); full=True every .py file."""
    return _copier(tmp_path, "fork", built_fork_tree)


def export_source(dest: Path) -> Path:
    """A copy of this checkout's sources at `dest`: the files git tracks plus the untracked ones
    it does not ignore (what a clean clone of the working tree holds). Tests build and install
    k3patch from it, never from the checkout itself: setuptools reuses an in-tree `build/`, and
    a stale one ships modules that were deleted since (a patch that became a folder, say)."""
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
    )
    if proc.returncode == 0:
        for rel in filter(None, proc.stdout.decode().split("\0")):
            source = ROOT / rel
            if source.is_symlink():  # k3patch/patches -> ../patches, kept a link
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(os.readlink(source), dest / rel)
            elif source.is_file():
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, dest / rel)
    else:  # not a git checkout: everything but build outputs, venvs and caches
        shutil.copytree(
            ROOT,
            dest,
            symlinks=True,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns(
                "build", "dist", ".venv*", "*.egg-info", "__pycache__", ".git", ".*_cache"
            ),
        )
    return dest


@pytest.fixture(scope="session")
def k3patch_source(tmp_path_factory) -> Path:
    """This checkout's sources, exported once per session (see export_source)."""
    return export_source(tmp_path_factory.mktemp("k3patch-source"))


def tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under root (relative path -> hex), to prove what changed."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            out[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


# A job that a non-interactive shell starts in the background (`pytest ... &`, nohup, some CI
# runners) inherits SIGINT ignored; an ignored signal stays ignored across exec, and Python then
# installs no KeyboardInterrupt handler. Right for k3patch (it keeps what it was given), but a
# test that interrupts its child must give the child the default disposition first. Not
# `preexec_fn`: it can deadlock a process with threads (an xdist worker has them).
_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def interruptible(argv: list[str]) -> list[str]:
    """`argv` (a full path first) as a command that runs it with SIGINT at its default, whatever
    this process inherited: the same process (exec), so its pid is the one to signal."""
    return [sys.executable, "-c", _DEFAULT_SIGINT, *argv]


def run_cli(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float | None = None,
):
    """Run the installed CLI as a user would (a subprocess), returning CompletedProcess.
    `timeout`: where a hang is the defect under test (a FIFO), fail instead of hanging."""
    full_env = {**os.environ, "NO_COLOR": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "k3patch", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )


def status_json(site: Path, *args: str) -> dict:
    """`k3patch status --json` on a tree, with its exit code under "_rc"."""
    proc = run_cli("status", "--vllm", str(site), "--json", *args)
    data = json.loads(proc.stdout)
    data["_rc"] = proc.returncode
    return data


def sites_of(site: Path, *args: str) -> dict[str, dict]:
    """The first reported patch's sites by name (use --only to choose the patch)."""
    return {s["site"]: s for s in status_json(site, *args)["patches"][0]["sites"]}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


VERIFY_PYTHON_ENV = "K3PATCH_TEST_VLLM_PYTHON"


@pytest.fixture(scope="session")
def verify_python() -> str:
    """An interpreter with torch (CPU) and vLLM's pure-Python deps (see .ci/run). CI sets it;
    running the suite without it is an error, not a skip, so a green run always imported vLLM."""
    python = os.environ.get(VERIFY_PYTHON_ENV)
    if not python:
        pytest.fail(
            f"{VERIFY_PYTHON_ENV} is not set: run .ci/run, or point it at an interpreter "
            "with torch==2.13.0 and shared/cpu-import-deps.txt installed"
        )
    return python


# --------------------------------------------------------------------------------------------
# A probe's oracle for hypothesis: one long-lived child of the tree's interpreter (vLLM imported
# once) runs `serve` (probekit.serve) of a probe module; judge(case) -> what went wrong.
ORACLE_CHILD = """
import importlib, sys, types
sys.path.insert(0, sys.argv[1])
for name, where in (("k3patch", sys.argv[2]), ("k3patch.patches", sys.argv[3])):
    module = types.ModuleType(name)
    module.__path__ = [where]
    sys.modules[name] = module
serve = getattr(importlib.import_module(sys.argv[4]), sys.argv[5])
serve(iter(sys.stdin.readline, ""), lambda line: print("K3PATCH-ORACLE " + line, flush=True))
"""


class OracleChild:
    """`serve` ("module:function") in the tree at `site`; `judge(case)` sends a dataclass."""

    def __init__(self, python: str, site: Path, serve: str) -> None:
        import dataclasses

        import k3patch
        from k3patch.registry import patches_dir

        self.asdict = dataclasses.asdict
        package = str(Path(k3patch.__file__).parent)
        args = [python, "-c", ORACLE_CHILD, str(site), package, str(patches_dir())]
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
        self.child = subprocess.Popen(
            [*args, *serve.split(":")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def judge(self, case: object) -> list[str]:
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(json.dumps(self.asdict(case)) + "\n")  # type: ignore[call-overload]
        self.child.stdin.flush()
        for line in self.child.stdout:  # vLLM logs to stdout too
            if line.startswith("K3PATCH-ORACLE "):
                return json.loads(line.split(" ", 1)[1])
        raise AssertionError("the oracle child died")

    def close(self) -> None:
        if self.child.stdin is not None:
            self.child.stdin.close()
        self.child.wait(timeout=60)


# --------------------------------------------------------------------------------------------
# Patch tables in the spirit of LibCST's CodemodTest: a patch run in memory over a few files
# (paths relative to the `vllm` package), no tree, no CLI.


def patch_named(patch_id: str):
    from k3patch.registry import all_patches

    return next(p for p in all_patches() if p.id == patch_id)


def classify_files(patch_id: str, files: dict[str, str]) -> dict[str, object]:
    """The patch's site results on `files` (absent paths read as absent files), by site name."""
    from k3patch.sources import Sources

    sources = Sources(lambda rel: files[rel].encode() if rel in files else None)
    return {r.site: r for r in patch_named(patch_id).classify(sources)}


def assert_untouched(patch_id: str, files: dict[str, str]) -> dict[str, object]:
    """Nothing to write: no site is pending, or a drifted site makes the engine refuse the patch.
    Returns the site results for the caller's own assertions."""
    from k3patch.verdicts import Verdict, summarise

    found = classify_files(patch_id, files)
    assert summarise(r.verdict for r in found.values()) is not Verdict.PENDING, found
    return found


def cached_tree(spec: str) -> Path:
    """The read-only tree `spec` names: "fork:a" (tests/forktree), "fixture:NAME" (fixtures/),
    or a version ("0.31.0", a real wheel)."""
    kind, _, name = spec.rpartition(":")
    if kind == "fork":
        return built_fork_tree(name)
    if kind == "fixture":
        return FIXTURES / name
    return pristine_tree(name)


def _once_per_run(tmp_path_factory, key: str, make: Callable[[], dict]) -> dict:
    """make()'s result, computed once per pytest run: under pytest-xdist the first worker to ask
    computes it and the others wait for it and read it (a verify child imports torch and vLLM:
    seconds each, and many test modules read the same tree's probes)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return make()
    path = tmp_path_factory.getbasetemp().parent / f"once-{key}.json"
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            path.write_text(json.dumps(make()))
        return json.loads(path.read_text())


@pytest.fixture(scope="session")
def verified(tmp_path_factory, verify_python) -> Callable[[str], dict]:
    """verified("fork:a") -> what `apply` then `verify --json` (every patch) said on a full copy
    of that tree (see cached_tree), run once per test run and shared by every test that reads it.
    Keys: apply_rc, verify_rc, verify (the JSON's `verify` object), patches (its patches by id),
    output (the tail of both commands' output, for assertion messages)."""
    done: dict[str, dict] = {}

    def make(spec: str) -> dict:
        site = tmp_path_factory.mktemp("verified") / "site"
        shutil.copytree(cached_tree(spec), site, ignore=shutil.ignore_patterns(".complete"))
        applied = run_cli("apply", "--vllm", str(site))
        proc = run_cli("verify", "--vllm", str(site), "--python", verify_python, "--json")
        data = json.loads(proc.stdout)["verify"] if proc.stdout else {}
        return {
            "apply_rc": applied.returncode,
            "verify_rc": proc.returncode,
            "verify": data,
            "patches": {p["id"]: p for p in data.get("patches", [])},
            "output": applied.stdout[-2000:] + proc.stdout[-3000:] + proc.stderr[-2000:],
        }

    def get(spec: str) -> dict:
        if spec not in done:
            key = "verified-" + spec.replace(":", "-")
            done[spec] = _once_per_run(tmp_path_factory, key, lambda: make(spec))
        return done[spec]

    return get


@pytest.fixture(scope="session")
def probed(tmp_path_factory, verify_python) -> Callable[[str, str], dict]:
    """probed("fork:a", patch_id) -> that patch's probe result (ok, summary, checks) on the
    UNPATCHED tree: verify runs probes only for applied patches, so this runs every patch's probe
    in one verify child over the cached tree, whatever the verdicts, once per test run. Every
    module the patch names must import."""
    done: dict[str, dict] = {}

    from k3patch.registry import all_patches

    def make(spec: str) -> dict:
        from probe_child import child_args

        from k3patch import verify as verify_mod
        from k3patch.tree import locate

        return verify_mod._run_child(
            verify_python, locate(cached_tree(spec)), child_args(*all_patches())
        )

    def get(spec: str, patch_id: str) -> dict:
        if spec not in done:
            key = "probed-" + spec.replace(":", "-")
            done[spec] = _once_per_run(tmp_path_factory, key, lambda: make(spec))
        result = done[spec]
        (patch,) = [p for p in all_patches() if p.id == patch_id]
        imports = {m: result["imports"][m] for m in patch.modules}
        assert all(r["ok"] for r in imports.values()), imports
        # The tree's own code ran, not an installed vLLM's.
        root = str(cached_tree(spec))
        assert all(r["file"].startswith(root) for r in imports.values()), imports
        probe: dict = result["probes"][patch_id]
        assert "error" not in probe, probe
        return probe

    return get


def slow_except(values: list[str], *kept: str) -> list:
    """`values` as parameters, all but `kept` marked slow: a plain pytest runs the kept trees,
    .ci/run every tree (README: the tests marked slow)."""
    return [v if v in kept else pytest.param(v, marks=pytest.mark.slow) for v in values]


def slow_after(values: Iterable, keep: int = 1, *, unpack: bool = False) -> list:
    """`values` as parameters, the first `keep` as they are and the rest marked slow: a plain
    pytest checks each behaviour on its first rows, .ci/run on every row (README: the tests
    marked slow). `unpack`: each value is a tuple of the test's several arguments."""
    out = []
    for index, value in enumerate(values):
        if index < keep:
            out.append(value)
        elif isinstance(value, type(pytest.param())):
            out.append(pytest.param(*value.values, id=value.id, marks=[*value.marks, SLOW]))
        else:
            out.append(pytest.param(*(value if unpack else (value,)), marks=SLOW))
    return out
