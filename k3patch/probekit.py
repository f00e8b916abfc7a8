"""What a behaviour probe needs in the verify child, written once: stand-ins that are always
undone, stand-in objects, calls that fit any release's signature, the tree's own statements run
on their own, and checks that become a `ProbeOutcome`. Runs in the tree's own interpreter, where
k3patch is not installed: standard library and k3patch's standard-library modules only."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import inspect
import json
import logging
import logging.handlers
import os
import sys
import textwrap
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

from k3patch.patch import ProbeOutcome

T = TypeVar("T")


class Swap(contextlib.ExitStack):
    """Stand-ins (`unittest.mock` patches) put back on exit in reverse order, also when the
    probe raises; `on_exit(func, *args)` (ExitStack's `callback`) puts back what only a setter
    can (`swap.on_exit(set_role, get_role())`)."""

    on_exit = contextlib.ExitStack.callback

    def env(self, name: str, value: str | None) -> None:
        """Set (or with None, unset) an environment variable."""
        self.enter_context(mock.patch.dict(os.environ, {} if value is None else {name: value}))
        if value is None:
            os.environ.pop(name, None)

    def attr(self, obj: Any, name: str, value: Any) -> None:
        """Set an attribute: an own one is restored, an inherited or absent one removed again."""
        self.enter_context(mock.patch.object(obj, name, value, create=True))

    def module(self, name: str, module: types.ModuleType | None = None) -> types.ModuleType:
        """Put `module` (default: a new empty one) in sys.modules under `name`."""
        module = module if module is not None else types.ModuleType(name)
        # Put back by key: mock.patch.dict restores a snapshot, which would drop every module
        # imported meanwhile (and import it anew, as other objects, later).
        old = sys.modules.get(name)
        if old is None:
            self.callback(sys.modules.pop, name, None)
        else:
            self.callback(sys.modules.__setitem__, name, old)
        sys.modules[name] = module
        return module

    def log(self, name: str, level: int) -> list[logging.LogRecord]:
        """The records of at least `level` that logger `name` handles from now on, the logger's
        own level set to `level` meanwhile (a tree may have configured it quieter)."""
        logger = logging.getLogger(name)
        handler = logging.handlers.BufferingHandler(capacity=1 << 20)
        handler.setLevel(level)
        self.callback(logger.setLevel, logger.level)
        self.callback(logger.removeHandler, handler)
        logger.addHandler(handler)
        logger.setLevel(level)
        return handler.buffer


class Stub(types.SimpleNamespace):
    """A stand-in holding the attributes it is given, compared and hashed by identity and
    weakly referenceable as the objects it stands for (a request, a worker, a tensor) are."""

    __eq__ = object.__eq__
    __ne__ = object.__ne__
    __hash__ = object.__hash__  # type: ignore[assignment]


def stand_in(cls: type[T], **attributes: Any) -> T:
    """An instance of the real class `cls` without running its `__init__` (which needs a GPU,
    a network or a library the probe lacks), holding only `attributes`."""
    obj: T = object.__new__(cls)
    for name, value in attributes.items():
        setattr(obj, name, value)
    return obj


class Always(dict):  # type: ignore[type-arg]
    """A mapping that holds every key, each mapped to `value`."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: object) -> Any:
        return self.value


class Calls:
    """A callable stand-in that answers each call with `answer(*args, **kwargs)` and keeps every
    call as (args, kwargs, answer), in order."""

    def __init__(self, answer: Callable[..., Any]) -> None:
        self.answer = answer
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.answer(*args, **kwargs)
        self.calls.append((args, kwargs, result))
        return result


def call_accepted(func: Callable[..., T], **kwargs: Any) -> T:
    """`func` called with those of `kwargs` its signature takes (releases differ)."""
    params = inspect.signature(func).parameters
    return func(**{k: v for k, v in kwargs.items() if k in params})


def attempt(func: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T | None, str | None]:
    """`(func(*args, **kwargs), None)`, or `(None, "Type: message")` when it raised an
    Exception: a probe reports one failed call of the tree's code and goes on."""
    try:
        return func(*args, **kwargs), None
    except Exception as exc:  # reported by the caller, never swallowed
        return None, f"{type(exc).__name__}: {exc}"


def package_dir(name: str) -> Path | None:
    """The directory of the top-level package `name`, found without importing it; None for an
    absent package or a plain module."""
    spec = importlib.util.find_spec(name)
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(next(iter(locations))) if locations else None


class TorchTrace(contextlib.ExitStack):
    """Records, restarted on each entry, the name and positional arguments of every torch
    function or tensor method run inside it (`calls`) and every aten op below them (`aten`);
    nothing inside `paused()` (a stand-in's own work). Imports torch only when entered."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.aten: list[str] = []
        self._paused = False

    def __enter__(self) -> TorchTrace:
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        trace = self

        class Functions(TorchFunctionMode):
            def __torch_function__(
                self, fn: Any, types_: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                if not trace._paused:
                    trace.calls.append((getattr(fn, "__name__", str(fn)), tuple(args)))
                return fn(*args, **(kwargs or {}))

        class Aten(TorchDispatchMode):
            def __torch_dispatch__(
                self, fn: Any, types_: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                if not trace._paused:
                    trace.aten.append(str(fn))
                return fn(*args, **(kwargs or {}))

        self.calls.clear()
        self.aten.clear()
        self.enter_context(Functions())
        self.enter_context(Aten())
        return self

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused = True
        try:
            yield
        finally:
            self._paused = False


def cuda_looking(*tensors: Any) -> tuple[Any, ...]:
    """CPU tensors as views whose `is_cuda` is True, for code that asserts device tensors
    (`.as_subclass(torch.Tensor)` undoes it)."""
    return tuple(t.as_subclass(_cuda_looking_class()) for t in tensors)


@functools.cache
def _cuda_looking_class() -> type:
    import torch

    class CudaLooking(torch.Tensor):
        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

    return CudaLooking


def triton_on_host(
    func: ast.AST, module_globals: Mapping[str, Any], launch: Callable[..., Any]
) -> dict[str, Any]:
    """Globals under which `func` runs on the host: each kernel it launches (`kernel[grid](...)`)
    calls `launch`, and a `triton` with the host helpers `next_power_of_2` and `cdiv` where the
    module's lacks them (a placeholder module on a machine without Triton)."""
    names: dict[str, Any] = {
        node.func.value.id: Always(launch)
        for node in ast.walk(func)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and isinstance(node.func.value, ast.Name)
    }
    if not all(hasattr(module_globals.get("triton"), a) for a in ("next_power_of_2", "cdiv")):
        names["triton"] = types.SimpleNamespace(
            next_power_of_2=lambda n: 1 << max(int(n) - 1, 0).bit_length(),
            cdiv=lambda a, b: -(a // -b),
        )
    return names


def source_of(func: Callable[..., Any]) -> ast.FunctionDef | None:
    """The parsed definition of a live function, line numbers as in its file; None without
    source."""
    try:
        lines, first = inspect.getsourcelines(func)
    except (OSError, TypeError):
        return None
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    return ast.increment_lineno(node, first - 1)


def run_statements(func: Callable[..., Any], body: list[ast.stmt], *args: Any) -> None:
    """Run `body` (statements of `func`'s definition, from `source_of`) as a function with
    `func`'s parameters and globals, called with `args`: one stretch of the tree's own code
    whose other statements cannot run here."""
    node = source_of(func)
    if node is None:
        raise ValueError(f"{func.__qualname__} has no source")
    node.name, node.body, node.decorator_list = "_k3patch_probe_statements", body, []
    module = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
    namespace = dict(func.__globals__)
    exec(compile(module, func.__code__.co_filename, "exec"), namespace)
    namespace[node.name](*args)


class Checks:
    """Named checks, each passed or failed, summarised as one ProbeOutcome."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.lines: list[str] = []
        self.failures: list[str] = []
        self.ran = 0

    def note(self, line: str) -> None:
        """A report line that is no check (what was skipped, and why)."""
        self.lines.append(line)

    def record(self, line: str, ok: bool = True, failure: str | None = None) -> bool:
        """A check reported as `line`; a failed one says `failure` (default: `line`)."""
        self.ran += 1
        self.lines.append(line)
        if not ok:
            self.failures.append(line if failure is None else failure)
        return ok

    def fail(self, failure: str) -> None:
        """A failure that is no single check (a case that could not run)."""
        self.failures.append(failure)

    def check(self, case: str, ok: bool, why: str = "") -> bool:
        line = f"{case}: {'ok' if ok else 'FAILED'}{f' ({why})' if why else ''}"
        return self.record(line, ok, f"{case}{f': {why}' if why else ''}")

    def expect(self, case: str, got: Any, want: Any) -> bool:
        ok = got == want
        return self.check(f"{case} -> {got!r}", ok, "" if ok else f"expected {want!r}")

    def outcome(self, holds: str | None = None, broken: str | None = None) -> ProbeOutcome:
        """Failed when something failed or no check ran. `holds` (default "{what} holds ({ran}
        cases)") and `broken` (default "{what} broken: {failures}") are the summaries, as
        `str.format` templates over what, ran, failed (how many) and failures ("; "-joined)."""
        if not self.failures and not self.ran:
            return ProbeOutcome(False, f"{self.what}: no check ran", tuple(self.lines))
        if self.failures:
            template = broken or "{what} broken: {failures}"
        else:
            template = holds or "{what} holds ({ran} cases)"
        failures = "; ".join(self.failures)
        summary = template.format(
            what=self.what, ran=self.ran, failed=len(self.failures), failures=failures
        )
        return ProbeOutcome(not self.failures, summary, tuple(self.lines))


def seeded(checks: Checks, noun: str, seeds: Any, generate: Any, wrongs: Any, shrink: Any) -> None:
    """An oracle over generated cases: per seed the case `generate(seed)`, judged by `wrongs(case)`
    -> (what went wrong, a summary), a check naming the seed; the first failing case shrunk by
    `shrink(case, fails)` and reported by its `describe()`. A raise: this tree cannot be driven."""
    first: Any = None
    for seed in seeds:
        case = generate(seed)
        try:
            wrong, about = wrongs(case)
        except Exception as exc:
            return checks.fail(f"{noun} seed {seed}: cannot drive this tree: {exc!r}")
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        verdict = "FAILED: " + "; ".join(wrong) if wrong else "ok"
        short = f"{noun} seed {seed}: {wrong[0] if wrong else ''}{more}"
        if not checks.record(f"{noun} seed {seed} ({about}): {verdict}", not wrong, short):
            first = (seed, case) if first is None else first
    if first is not None:
        small = shrink(first[1], lambda c: bool(wrongs(c)[0]))
        wrong = "; ".join(wrongs(small)[0] or ["(no longer fails)"])
        checks.fail(f"smallest failing {noun} of seed {first[0]}: {small.describe()} -> {wrong}")
    return None


def serve(lines: Any, answer: Callable[[str], Any], parse: Any, wrongs: Any) -> None:
    """An oracle for a test driver (hypothesis draws the cases; its interpreter has no vLLM): per
    JSON case read from `lines`, `answer` gets the JSON list of what `wrongs` says went wrong."""
    for line in lines:
        answer(json.dumps(wrongs(parse(json.loads(line)))[0]))
