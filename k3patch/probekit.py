"""What a behaviour probe needs in the verify child, written once: stand-ins that are always
undone (environment variables, attributes, whole modules), stand-in objects (a weakly
referenceable namespace, a real class's instance built without its `__init__`, a mapping that
holds every key), calls that fit any release's signature, the tree's own statements run on
their own, and a list of checks that becomes a `ProbeOutcome`.

Runs in the tree's own interpreter, where k3patch is not installed: standard library and
k3patch's own standard-library modules only.

    checks = Checks("truth table")
    with Swap() as swap:
        swap.module("vllm.platforms.rocm", fake)
        swap.env("VLLM_ROCM_USE_AITER_MLA", None)      # None: unset
        swap.attr(ops, "_MLA_ENABLED", True)
        checks.expect("unset on gfx942", got=call(), want=False)
    return checks.outcome()
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import inspect
import logging
import logging.handlers
import os
import sys
import textwrap
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from k3patch.patch import ProbeOutcome

_ABSENT = object()
T = TypeVar("T")


class Swap:
    """A context manager that stands things in and puts every one back on exit, in reverse
    order, also when the probe raises."""

    def __init__(self) -> None:
        self._undo: list[Any] = []

    def __enter__(self) -> Swap:
        return self

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()

    def env(self, name: str, value: str | None) -> None:
        """Set (or with None, unset) an environment variable."""
        old = os.environ.get(name)

        def undo() -> None:
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old

        self._undo.append(undo)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    def attr(self, obj: Any, name: str, value: Any) -> None:
        """Set an attribute (a class's own attribute is restored as its own, an inherited or
        absent one is removed again)."""
        own = vars(obj).get(name, _ABSENT) if hasattr(obj, "__dict__") else _ABSENT

        def undo() -> None:
            if own is _ABSENT:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, own)

        self._undo.append(undo)
        setattr(obj, name, value)

    def module(self, name: str, module: types.ModuleType | None = None) -> types.ModuleType:
        """Put `module` (default: a new empty one) in sys.modules under `name`."""
        module = module if module is not None else types.ModuleType(name)
        old = sys.modules.get(name)

        def undo() -> None:
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old

        self._undo.append(undo)
        sys.modules[name] = module
        return module

    def on_exit(self, func: Callable[..., object], *args: Any) -> None:
        """Call `func(*args)` on exit, in turn with the other undos: state only a setter puts
        back (`swap.on_exit(set_role, get_role())`)."""
        self._undo.append(lambda: func(*args))

    def log(self, name: str, level: int) -> list[logging.LogRecord]:
        """The records of at least `level` that logger `name` handles from now on, the logger's
        own level set to `level` meanwhile (a tree may have configured it quieter)."""
        logger = logging.getLogger(name)
        handler = logging.handlers.BufferingHandler(capacity=1 << 20)
        handler.setLevel(level)
        self.on_exit(logger.setLevel, logger.level)
        self.on_exit(logger.removeHandler, handler)
        logger.addHandler(handler)
        logger.setLevel(level)
        return handler.buffer


class Stub(types.SimpleNamespace):
    """A stand-in holding the attributes it is given that behaves as the objects it stands for
    (a request, a worker, a tensor) do: compared and hashed by identity, weakly referenceable."""

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
    """`func` called with those of `kwargs` its signature takes (signatures differ between
    releases of the code a probe drives)."""
    params = inspect.signature(func).parameters
    return func(**{k: v for k, v in kwargs.items() if k in params})


def attempt(func: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T | None, str | None]:
    """`(func(*args, **kwargs), None)`, or `(None, "Type: message")` when the call raised an
    Exception: a probe reports the failure of one call of the tree's code and goes on."""
    try:
        return func(*args, **kwargs), None
    except Exception as exc:  # reported by the caller, never swallowed
        return None, f"{type(exc).__name__}: {exc}"


def package_dir(name: str) -> Path | None:
    """The directory of the importable top-level package `name`, found without importing it;
    None when there is none (absent, or a plain module)."""
    spec = importlib.util.find_spec(name)
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(next(iter(locations))) if locations else None


def with_globals(func: Callable[..., T], **names: Any) -> Callable[..., T]:
    """A copy of the plain function `func` that sees `names` in place of (or beside) its module
    globals; the module itself is left as it is."""
    code: Any = func
    copy = types.FunctionType(
        code.__code__,
        {**code.__globals__, **names},
        code.__name__,
        code.__defaults__,
        code.__closure__,
    )
    copy.__kwdefaults__ = code.__kwdefaults__
    return copy


class TorchTrace:
    """A reusable context manager that records what torch runs inside it, both lists restarted
    on entry: `calls`, the name and positional arguments of every torch function or tensor
    method (a TorchFunctionMode), and `aten`, every aten op dispatched below them (a
    TorchDispatchMode). Nothing is recorded inside `paused()` (a stand-in's own work). Imports
    torch only when entered."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.aten: list[str] = []
        self._paused = False
        self._modes: list[Any] = []

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
        self._modes = [Functions(), Aten()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        while self._modes:
            self._modes.pop().__exit__(*exc)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused = True
        try:
            yield
        finally:
            self._paused = False


def cuda_looking(*tensors: Any) -> tuple[Any, ...]:
    """The CPU tensors as views that answer `is_cuda` True, for code that asserts a device
    tensor before work a probe runs on the host (`.as_subclass(torch.Tensor)` undoes it)."""
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
    """Globals under which a function that launches Triton kernels runs on the host: every
    name `func` launches Triton-style (`kernel[grid](...)`) calls `launch` instead, and where
    the module's `triton` lacks the host helpers `next_power_of_2` and `cdiv` (a placeholder
    module on a machine without Triton), a `triton` that has them."""
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
    """The parsed definition of a live function, line numbers as in its file; None when it has
    no source."""
    try:
        lines, first = inspect.getsourcelines(func)
    except (OSError, TypeError):
        return None
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    if not isinstance(node, ast.FunctionDef):
        return None
    return ast.increment_lineno(node, first - 1)


def run_statements(func: Callable[..., Any], body: list[ast.stmt], *args: Any) -> None:
    """Run `body` (statements of `func`'s own definition, from `source_of`) as a function with
    `func`'s parameters and globals, called with `args`: the tree's own text of one stretch of
    a function whose other statements cannot run here."""
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
        """A check reported as `line`; a failed one says `failure` (default: the line) in the
        summary."""
        self.ran += 1
        self.lines.append(line)
        if not ok:
            self.failures.append(line if failure is None else failure)
        return ok

    def fail(self, failure: str) -> None:
        """A failure that is no single check (a case that could not run, several checks'
        failures in one sentence)."""
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
        fields = {
            "what": self.what,
            "ran": self.ran,
            "failed": len(self.failures),
            "failures": "; ".join(self.failures),
        }
        if self.failures:
            summary = (broken or "{what} broken: {failures}").format(**fields)
            return ProbeOutcome(False, summary, tuple(self.lines))
        if not self.ran:
            return ProbeOutcome(False, f"{self.what}: no check ran", tuple(self.lines))
        summary = (holds or "{what} holds ({ran} cases)").format(**fields)
        return ProbeOutcome(True, summary, tuple(self.lines))
