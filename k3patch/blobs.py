"""The saved copies in `vllm/.k3patch/blobs/`: every before-image of a commit, named by its
sha256, so that a revert (or the rollback of an interrupted commit) puts back the exact bytes.
Only blob-named regular files are ever read or pruned; anything else there is left alone.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from k3patch.errors import EnvironmentProblem
from k3patch.replace import unlink_in, write_atomically
from k3patch.safefs import read_in
from k3patch.state import saved_copy_names

BLOBS = "blobs"
NAME = re.compile(r"^[0-9a-f]{64}$")


class Blobs:
    """The saved copies of the tree whose package dir is `package_dir`."""

    def __init__(self, package_dir: Path) -> None:
        self.package_dir = package_dir
        self.rel_dir = f".k3patch/{BLOBS}"
        self.dir = package_dir / self.rel_dir

    def _read(self, digest: str) -> bytes | None:
        return read_in(self.package_dir, f"{self.rel_dir}/{digest}", what="saved copy")

    def store(self, data: bytes) -> None:
        """Save `data` (once: a copy already there is kept)."""
        digest = hashlib.sha256(data).hexdigest()
        if self._read(digest) != data:
            write_atomically(self.dir / digest, data, root=self.package_dir)

    def load(self, digest: str) -> bytes:
        """The saved copy named `digest`, checked against its name."""
        if not NAME.match(digest):
            raise EnvironmentProblem(f"{digest!r} is not a saved-copy name; the record is damaged")
        data = self._read(digest)
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            raise EnvironmentProblem(
                f"the saved copy {self.dir / digest} is missing or damaged; "
                "reinstall vLLM to get the original files back"
            )
        return data

    def names(self) -> list[str]:
        return saved_copy_names(self.package_dir)

    def prune(self, keep: set[str]) -> None:
        """Remove every saved copy not in `keep`: only blob-named regular files."""
        for name in self.names():
            if name not in keep:
                unlink_in(self.package_dir, f"{self.rel_dir}/{name}")
