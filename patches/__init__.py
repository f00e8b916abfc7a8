"""One folder per patch, each defining a `Patch` subclass and `PATCH`; installed as
`k3patch.patches`. Each folder's `files.txt` lists the files (under the vllm package dir) its
patch reads, one a line: `TARGETS`, their union, is what the no-op path hashes, read here without
importing a patch (importing the four costs about 100 ms, five times the whole no-op run). The
registry holds each `files.txt` equal to its patch's `files`.
"""

from __future__ import annotations

import os

FILES_TXT = "files.txt"


def declared_files(folder: str) -> tuple[str, ...]:
    """The paths a patch folder's files.txt lists (blank lines and `#` lines left out); ()
    when it has none."""
    try:
        with open(os.path.join(folder, FILES_TXT), encoding="utf-8") as handle:
            lines = [line.strip() for line in handle]
    except FileNotFoundError:
        return ()
    return tuple(line for line in lines if line and not line.startswith("#"))


def _folders() -> list[os.DirEntry[str]]:
    with os.scandir(os.path.dirname(os.path.abspath(__file__))) as entries:
        return sorted(
            (
                e
                for e in entries
                if e.is_dir()
                and not e.name.startswith(("_", "."))
                and os.path.isfile(os.path.join(e.path, "__init__.py"))
            ),
            key=lambda e: e.name,
        )


# patch folder name -> the files its files.txt lists
DECLARED: dict[str, tuple[str, ...]] = {e.name: declared_files(e.path) for e in _folders()}
TARGETS: tuple[str, ...] = tuple(dict.fromkeys(f for files in DECLARED.values() for f in files))
