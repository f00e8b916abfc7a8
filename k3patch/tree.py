"""Finds the vLLM tree to work on, without importing vLLM, and reads its version."""

from __future__ import annotations

import importlib.machinery
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path


class TreeError(Exception):
    """The tree cannot be used. `usage` is True when the user pointed at the wrong thing."""

    def __init__(self, message: str, *, usage: bool) -> None:
        super().__init__(message)
        self.usage = usage


@dataclass(frozen=True)
class VllmTree:
    package_dir: Path  # the `vllm` package directory
    root: Path  # the directory that holds `vllm/` (site-packages or a source checkout)
    kind: str  # "site-packages", "source checkout" or "package dir"
    version: str | None
    version_source: str

    @property
    def state_dir(self) -> Path:
        """Where k3patch keeps its record, journal and original blobs: inside the package."""
        return self.package_dir / ".k3patch"

    def path(self, rel: str) -> Path:
        return self.package_dir / rel

    def read(self, rel: str) -> bytes | None:
        """A target file's bytes, or None when absent. A symlinked target is refused."""
        path = self.path(rel)
        if path.is_symlink():
            raise TreeError(
                f"{path} is a symlink to {os.path.realpath(path)}; k3patch replaces files "
                "atomically and will not turn a link into a copy. Patch the link's target tree.",
                usage=True,
            )
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise TreeError(f"{path} is a directory, expected a Python file", usage=True) from None
        except PermissionError:
            raise TreeError(
                f"{path}: permission denied reading it; run as the tree's owner", usage=False
            ) from None


def _looks_like_vllm(package_dir: Path) -> bool:
    return (package_dir / "__init__.py").is_file() and (package_dir / "envs.py").is_file()


def locate(path: str | os.PathLike[str] | None = None) -> VllmTree:
    """The vLLM tree at `path` (package dir, source checkout or site-packages), or, with no
    path, the one the running interpreter would import, found without importing it."""
    if path is None:
        spec = importlib.machinery.PathFinder.find_spec("vllm", sys.path)
        if spec is None or not spec.submodule_search_locations:
            raise TreeError(
                f"no vLLM found for {sys.executable}; pass --vllm PATH "
                "(the vllm package dir, a source checkout or a site-packages dir)",
                usage=False,
            )
        package_dir = Path(next(iter(spec.submodule_search_locations)))
    else:
        given = Path(path)
        if not given.exists():
            raise TreeError(f"{given}: no such directory", usage=True)
        if not given.is_dir():
            raise TreeError(f"{given}: not a directory; pass the vllm package dir", usage=True)
        if given.name == "vllm" and _looks_like_vllm(given):
            package_dir = given
        elif _looks_like_vllm(given / "vllm"):
            package_dir = given / "vllm"
        else:
            raise TreeError(
                f"{given}: not a vLLM tree (no vllm/__init__.py and vllm/envs.py); pass the vllm "
                "package dir, a source checkout holding vllm/, or a site-packages dir",
                usage=True,
            )
    if package_dir.is_symlink():
        raise TreeError(
            f"{package_dir} is a symlink to {os.path.realpath(package_dir)}; pass --vllm "
            f"{os.path.realpath(package_dir)} so the files are patched where they live",
            usage=True,
        )
    if not _looks_like_vllm(package_dir):
        raise TreeError(f"{package_dir}: not a vLLM package (no envs.py)", usage=True)
    # Parents may be links (a venv's lib64 -> lib); the package dir itself is not.
    package_dir = Path(os.path.realpath(package_dir.parent)) / package_dir.name
    root = package_dir.parent
    version, source = _read_version(root, package_dir)
    if source.startswith("dist-info"):
        kind = "site-packages"
    elif (root / "pyproject.toml").is_file() or (root / "setup.py").is_file():
        kind = "source checkout"
    else:
        kind = "package dir"
    return VllmTree(package_dir, root, kind, version, source)


_VERSION_LINE = re.compile(r"^Version:\s*(\S+)\s*$", re.MULTILINE)
_NAME_LINE = re.compile(r"^Name:\s*(\S+)\s*$", re.MULTILINE)
_VERSION_PY = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)


def _read_version(root: Path, package_dir: Path) -> tuple[str | None, str]:
    for dist_info in sorted(root.glob("vllm-*.dist-info")):
        metadata = dist_info / "METADATA"
        try:
            text = metadata.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        name = _NAME_LINE.search(text)
        version = _VERSION_LINE.search(text)
        if name and version and name.group(1).lower() == "vllm":
            return version.group(1), f"dist-info {dist_info.name}"
    version_py = package_dir / "_version.py"
    if version_py.is_file():
        match = _VERSION_PY.search(version_py.read_text(encoding="utf-8", errors="replace"))
        if match:
            return match.group(1), "vllm/_version.py"
    return None, "unknown (no dist-info METADATA or vllm/_version.py)"
