"""Finds the vLLM tree to work on, without importing vLLM, and reads its version."""

from __future__ import annotations

import base64
import csv
import os
import re
import stat
import sys
from pathlib import Path
from typing import NamedTuple

from k3patch.errors import TreeError
from k3patch.safefs import NotRegular, file_sha256, read_file


class VllmTree(NamedTuple):
    """A located vLLM tree (a NamedTuple: the no-op path locates one)."""

    package: str  # the `vllm` package directory, as the reports print it
    kind: str  # "site-packages", "source checkout" or "package dir"
    version: str | None
    version_source: str

    @property
    def info(self) -> dict[str, str | None]:
        """What every report says of the tree (its `vllm` object in the JSON)."""
        return {
            "package_dir": self.package,
            "kind": self.kind,
            "version": self.version,
            "version_source": self.version_source,
        }

    @property
    def package_dir(self) -> Path:
        return Path(self.package)

    @property
    def root(self) -> Path:
        """The directory that holds `vllm/` (site-packages or a source checkout)."""
        return self.package_dir.parent

    @property
    def state_dir(self) -> Path:
        """Where k3patch keeps its record, journal and original blobs: inside the package."""
        return self.package_dir / ".k3patch"

    def path(self, rel: str) -> Path:
        return self.package_dir / rel

    def read(self, rel: str) -> bytes | None:
        """A target file's bytes, or None when absent. A symlink, directory, FIFO or device
        where a module should be is refused before any read (safefs: never followed, never
        blocked on)."""
        path = os.path.join(self.package, rel)
        try:
            return read_file(path)
        except NotRegular as exc:
            if exc.kind == "symlink":
                raise TreeError(
                    f"{path} is a symlink to {os.path.realpath(path)}; k3patch replaces files "
                    "atomically and will not turn a link into a copy. Patch the link's target "
                    "tree.",
                    usage=True,
                ) from None
            if exc.kind == "directory":
                raise TreeError(
                    f"{path} is a directory, expected a Python file", usage=True
                ) from None
            raise TreeError(
                f"{path} is not a regular file (a FIFO, socket or device); expected a "
                "Python file. Reinstall vLLM",
                usage=False,
            ) from None
        except PermissionError:
            raise TreeError(
                f"{path}: permission denied reading it; run as the tree's owner", usage=False
            ) from None
        except OSError as exc:
            raise TreeError(f"{path}: cannot read it: {exc.strerror}", usage=False) from None


def _stat(path: str) -> os.stat_result | None:
    """None when nothing is there. Any other failure (EIO, a directory this user may not
    search) is the environment's, never "a wrong path" (os.path.exists would say False)."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except PermissionError:
        raise TreeError(
            f"cannot look at {path}: permission denied; run as the tree's owner", usage=False
        ) from None
    except OSError as exc:
        raise TreeError(f"cannot look at {path}: {exc.strerror or exc}", usage=False) from None


def _is_file(path: str) -> bool:
    found = _stat(path)
    return found is not None and stat.S_ISREG(found.st_mode)


def _looks_like_vllm(package_dir: str) -> bool:
    return all(_is_file(os.path.join(package_dir, f)) for f in ("__init__.py", "envs.py"))


def _search_path() -> list[str]:
    """Where `vllm serve` looks for vllm: this interpreter's sys.path without its first entry.
    That entry is the directory of whatever started the interpreter: the cwd under `python -m
    k3patch` (a checkout's root or a build context holding another vllm/), the bin directory
    for the `k3patch` script, and for `vllm serve` its own bin directory, which holds no vllm.
    With -P (safe_path) Python adds no such entry and the path is kept whole."""
    if getattr(sys.flags, "safe_path", False):
        return list(sys.path)
    return sys.path[1:]


def locate(path: str | os.PathLike[str] | None = None) -> VllmTree:
    """The vLLM tree at `path` (package dir, source checkout or site-packages), or, with no
    path, the one the running interpreter would import, found without importing it."""
    if path is None:
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec("vllm", _search_path())
        if spec is None or not spec.submodule_search_locations:
            raise TreeError(
                f"no vLLM found for {sys.executable}; pass --vllm PATH "
                "(the vllm package dir, a source checkout or a site-packages dir)",
                usage=False,
            )
        package_dir = str(next(iter(spec.submodule_search_locations)))
    else:
        given = os.fspath(path)
        found = _stat(given)
        if found is None:
            raise TreeError(f"{given}: no such directory", usage=True)
        if not stat.S_ISDIR(found.st_mode):
            raise TreeError(f"{given}: not a directory; pass the vllm package dir", usage=True)
        given = given.rstrip(os.sep) or os.sep
        leftovers = (os.path.join(given, ".k3patch"), os.path.join(given, "vllm", ".k3patch"))
        if os.path.basename(given) == "vllm" and _looks_like_vllm(given):
            package_dir = given
        elif _looks_like_vllm(os.path.join(given, "vllm")):
            package_dir = os.path.join(given, "vllm")
        elif orphan := next((d for d in leftovers if os.path.lexists(d)), None):
            # pip uninstall leaves `.k3patch` (it is not in the wheel's RECORD) in an otherwise
            # empty vllm/: not a wrong path, a leftover whose originals belong to no install.
            raise TreeError(
                f"{orphan} is k3patch's state of a vLLM that is no longer installed there (no "
                "vllm/__init__.py and envs.py); its saved originals belong to no install. "
                f"Reinstall vLLM, or remove {orphan}",
                usage=False,
            )
        else:
            why = "no vllm/__init__.py and vllm/envs.py"
            if _looks_like_vllm(given):  # Python imports vLLM only from a dir of that name
                why = "a package dir like vLLM's, but not named vllm"
            raise TreeError(
                f"{given}: not a vLLM tree ({why}); pass the vllm package dir, a source "
                "checkout holding vllm/, or a site-packages dir",
                usage=True,
            )
    if os.path.islink(package_dir):
        real = os.path.realpath(package_dir)
        where = f"pass --vllm {real}"
        if os.path.basename(real) != "vllm":
            where = "it is not named vllm: rename it vllm, point the link there and pass that"
        raise TreeError(
            f"{package_dir} is a symlink to {real}; k3patch patches files where they live, "
            f"never through a link: {where}",
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
    if source.startswith("dist-info") or _SEVERAL in source:
        kind = "site-packages"
    elif any(os.path.isfile(os.path.join(root, f)) for f in ("pyproject.toml", "setup.py")):
        kind = "source checkout"
    else:
        kind = "package dir"
    return VllmTree(package_dir, kind, version, source)


def _header(text: str, name: str) -> str | None:
    """The value of the first `Name: value` line of a METADATA file whose value is one word."""
    match = re.search(rf"^{re.escape(name)}:[ \t]*(\S+)[ \t\r]*$", text, re.MULTILINE)
    return match.group(1) if match else None


# `__version__ = "X"`, or `__version__ = version = "X"` as setuptools-scm writes it.
_VERSION_PY = re.compile(
    r"""^__version__[ \t]*=[ \t]*(?:version[ \t]*=[ \t]*)?['"]([^'"\n]+)['"]""", re.M
)


def _read_text(path: str, what: str) -> str | None:
    """A small file of the tree (METADATA, RECORD, `_version.py`) through safefs: None when
    absent or unreadable; a FIFO, device or symlink there is refused (exit 3), never opened
    blocking or followed."""
    try:
        data = read_file(path)
    except NotRegular as exc:
        raise TreeError(
            f"{path} is not a regular file ({exc.kind}); k3patch reads the vLLM {what} only from "
            "a regular file. Remove it or reinstall vLLM",
            usage=False,
        ) from None
    except OSError:
        return None
    return None if data is None else data.decode("utf-8", errors="replace")


# Package files k3patch never writes: their hashes in an install's RECORD stay true after an
# apply, so they tell which of several dist-infos installed the package that is there now.
_SEVERAL = "vllm dist-infos"
_OWNED = ("vllm/__init__.py", "vllm/envs.py", "vllm/_version.py")


def _owns(root: str, record: str | None) -> bool:
    """The RECORD lists the package's own files with the hashes they have now: this install is
    the one that put them there (an older dist-info left by `pip install --target --upgrade`
    lists other bytes)."""
    rows = csv.reader((record or "").splitlines())
    listed = {row[0]: row[1] for row in rows if len(row) >= 2 and row[0] in _OWNED}
    if not listed:
        return False
    for rel in _OWNED:
        try:
            digest = file_sha256(os.path.join(root, rel))
        except NotRegular as exc:
            raise TreeError(
                f"{os.path.join(root, rel)} is not a regular file ({exc.kind}); expected a "
                "Python file. Reinstall vLLM",
                usage=False,
            ) from None
        except OSError:
            return False
        if digest is None:
            continue
        encoded = base64.urlsafe_b64encode(bytes.fromhex(digest)).rstrip(b"=").decode()
        if listed.get(rel) != f"sha256={encoded}":
            return False
    return True


def _read_version(root: str, package_dir: str) -> tuple[str | None, str]:
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    found = []  # (dist-info name, version) of every vLLM dist-info beside the package
    for name in names:
        if not (name.startswith("vllm-") and name.endswith(".dist-info")):
            continue
        text = _read_text(os.path.join(root, name, "METADATA"), "METADATA") or ""
        found_name, version = _header(text, "Name"), _header(text, "Version")
        if found_name and version and found_name.lower() == "vllm":
            found.append((name, version))
    if len(found) == 1:
        name, version = found[0]
        return version, f"dist-info {name}"
    if found:
        # Several installs' metadata: only the one whose RECORD owns the package files is true.
        owners = [
            (name, version)
            for name, version in found
            if _owns(root, _read_text(os.path.join(root, name, "RECORD"), "RECORD"))
        ]
        if len(owners) == 1:
            name, version = owners[0]
            return version, f"dist-info {name} (its RECORD matches the package files)"
        return None, (
            f"unknown ({len(found)} {_SEVERAL} beside the package, "
            f"{'none' if not owners else len(owners)} of whose RECORD matches its files)"
        )
    version_py = _read_text(os.path.join(package_dir, "_version.py"), "_version.py")
    if match := _VERSION_PY.search(version_py or ""):
        return match.group(1), "vllm/_version.py"
    return None, "unknown (no dist-info METADATA or vllm/_version.py)"
