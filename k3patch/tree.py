"""Finds the vLLM tree to work on, without importing vLLM, and reads its version."""

from __future__ import annotations

import os
import sys

from k3patch.errors import TreeError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up cost)

if TYPE_CHECKING:
    from pathlib import Path


class VllmTree:
    """A located vLLM tree. Held as plain strings so the no-op path never imports pathlib;
    the Path views are made on first use."""

    __slots__ = ("kind", "package", "version", "version_source")

    def __init__(self, package: str, kind: str, version: str | None, version_source: str) -> None:
        self.package = package  # the `vllm` package directory
        self.kind = kind  # "site-packages", "source checkout" or "package dir"
        self.version = version
        self.version_source = version_source

    def __repr__(self) -> str:
        return f"VllmTree({self.package!r}, {self.kind!r}, {self.version!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VllmTree) and other.package == self.package

    def __hash__(self) -> int:
        return hash(self.package)

    @property
    def package_dir(self) -> Path:
        from pathlib import Path

        return Path(self.package)

    @property
    def root(self) -> Path:
        """The directory that holds `vllm/` (site-packages or a source checkout)."""
        return self.package_dir.parent

    @property
    def state(self) -> str:
        return os.path.join(self.package, ".k3patch")

    @property
    def state_dir(self) -> Path:
        """Where k3patch keeps its record, journal and original blobs: inside the package."""
        return self.package_dir / ".k3patch"

    def path(self, rel: str) -> Path:
        return self.package_dir / rel

    def read(self, rel: str) -> bytes | None:
        """A target file's bytes, or None when absent. A symlinked target is refused."""
        path = os.path.join(self.package, rel)
        if os.path.islink(path):
            raise TreeError(
                f"{path} is a symlink to {os.path.realpath(path)}; k3patch replaces files "
                "atomically and will not turn a link into a copy. Patch the link's target tree.",
                usage=True,
            )
        import stat

        try:
            # Non-blocking and checked before the first read: a FIFO or device where a module
            # should be is refused, never opened for reading (that would hang).
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except PermissionError:
            raise TreeError(
                f"{path}: permission denied reading it; run as the tree's owner", usage=False
            ) from None
        except OSError as exc:
            raise TreeError(f"{path}: cannot read it: {exc.strerror}", usage=False) from None
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise TreeError(f"{path} is a directory, expected a Python file", usage=True)
            if not stat.S_ISREG(mode):
                raise TreeError(
                    f"{path} is not a regular file (a FIFO, socket or device); expected a "
                    "Python file. Reinstall vLLM",
                    usage=False,
                )
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            return b"".join(chunks)
        except OSError as exc:
            raise TreeError(f"{path}: cannot read it: {exc.strerror}", usage=False) from None
        finally:
            os.close(fd)


def _looks_like_vllm(package_dir: str) -> bool:
    return os.path.isfile(os.path.join(package_dir, "__init__.py")) and os.path.isfile(
        os.path.join(package_dir, "envs.py")
    )


def locate(path: str | os.PathLike[str] | None = None) -> VllmTree:
    """The vLLM tree at `path` (package dir, source checkout or site-packages), or, with no
    path, the one the running interpreter would import, found without importing it."""
    if path is None:
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec("vllm", sys.path)
        if spec is None or not spec.submodule_search_locations:
            raise TreeError(
                f"no vLLM found for {sys.executable}; pass --vllm PATH "
                "(the vllm package dir, a source checkout or a site-packages dir)",
                usage=False,
            )
        package_dir = str(next(iter(spec.submodule_search_locations)))
    else:
        given = os.fspath(path)
        if not os.path.exists(given):
            raise TreeError(f"{given}: no such directory", usage=True)
        if not os.path.isdir(given):
            raise TreeError(f"{given}: not a directory; pass the vllm package dir", usage=True)
        given = given.rstrip(os.sep) or os.sep
        if os.path.basename(given) == "vllm" and _looks_like_vllm(given):
            package_dir = given
        elif _looks_like_vllm(os.path.join(given, "vllm")):
            package_dir = os.path.join(given, "vllm")
        elif orphan := next(
            (
                d
                for d in (os.path.join(given, ".k3patch"), os.path.join(given, "vllm", ".k3patch"))
                if os.path.lexists(d)
            ),
            None,
        ):
            # pip uninstall leaves `.k3patch` (it is not in the wheel's RECORD) in an otherwise
            # empty vllm/: not a wrong path, a leftover whose originals belong to no install.
            raise TreeError(
                f"{orphan} is k3patch's state of a vLLM that is no longer installed there (no "
                "vllm/__init__.py and envs.py); its saved originals belong to no install. "
                f"Reinstall vLLM, or remove {orphan}",
                usage=False,
            )
        else:
            raise TreeError(
                f"{given}: not a vLLM tree (no vllm/__init__.py and vllm/envs.py); pass the vllm "
                "package dir, a source checkout holding vllm/, or a site-packages dir",
                usage=True,
            )
    if os.path.islink(package_dir):
        real = os.path.realpath(package_dir)
        raise TreeError(
            f"{package_dir} is a symlink to {real}; pass --vllm {real} so the files are "
            "patched where they live",
            usage=True,
        )
    if not _looks_like_vllm(package_dir):
        raise TreeError(f"{package_dir}: not a vLLM package (no envs.py)", usage=True)
    # Parents may be links (a venv's lib64 -> lib); the package dir itself is not.
    package_dir = os.path.join(
        os.path.realpath(os.path.dirname(os.path.abspath(package_dir))), "vllm"
    )
    root = os.path.dirname(package_dir)
    version, source = _read_version(root, package_dir)
    if source.startswith("dist-info"):
        kind = "site-packages"
    elif os.path.isfile(os.path.join(root, "pyproject.toml")) or os.path.isfile(
        os.path.join(root, "setup.py")
    ):
        kind = "source checkout"
    else:
        kind = "package dir"
    return VllmTree(package_dir, kind, version, source)


def _header(text: str, name: str) -> str | None:
    """The value of the first `Name: value` line of a METADATA file whose value is one word.
    (Read with str methods: `re` imports `enum`, 3-6 ms on the no-op path of every rank.)"""
    for line in text.splitlines():
        if line.startswith(f"{name}:"):
            value = line[len(name) + 1 :].strip()
            if value and len(value.split()) == 1:
                return value
    return None


def _version_assignment(text: str) -> str | None:
    """`__version__ = "X"` (or `__version__ = version = "X"`) at the start of a line: X."""
    for line in text.splitlines():
        if not line.startswith("__version__"):
            continue
        rest = line[len("__version__") :].lstrip()
        if not rest.startswith("="):
            continue
        rest = rest[1:].lstrip()
        if rest.startswith("version") and rest[len("version") :].lstrip().startswith("="):
            rest = rest[len("version") :].lstrip()[1:].lstrip()
        if rest[:1] in ("'", '"'):
            end = min((i for i in (rest.find("'", 1), rest.find('"', 1)) if i > 0), default=-1)
            if end > 1:
                return rest[1:end]
    return None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _read_version(root: str, package_dir: str) -> tuple[str | None, str]:
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    for name in names:
        if not (name.startswith("vllm-") and name.endswith(".dist-info")):
            continue
        text = _read_text(os.path.join(root, name, "METADATA"))
        if text is None:
            continue
        found_name, version = _header(text, "Name"), _header(text, "Version")
        if found_name and version and found_name.lower() == "vllm":
            return version, f"dist-info {name}"
    text = _read_text(os.path.join(package_dir, "_version.py"))
    if text is not None:
        version = _version_assignment(text)
        if version:
            return version, "vllm/_version.py"
    return None, "unknown (no dist-info METADATA or vllm/_version.py)"
