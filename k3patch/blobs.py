"""The saved copies in `vllm/.k3patch/blobs/`: every before- and after-image of a commit, named
by its sha256, so that a revert (or the rollback of an interrupted commit) puts back the exact
bytes. Only blob-named regular files are ever read or pruned; anything else there is left alone.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from k3patch.errors import EnvironmentProblem
from k3patch.replace import write_temp
from k3patch.safefs import env_error, open_dir, open_dir_if_there, read_regular

BLOBS = "blobs"
NAME = re.compile(r"^[0-9a-f]{64}$")


class Blobs:
    """The saved copies of the tree whose package dir is `package_dir`."""

    def __init__(self, package_dir: Path) -> None:
        self.package_dir = package_dir
        self.rel_dir = f".k3patch/{BLOBS}"
        self.dir = package_dir / self.rel_dir

    def path(self, digest: str) -> Path:
        return self.dir / digest

    def store(self, data: bytes) -> str:
        """Save `data` (once: a copy already there is kept) and return its name."""
        digest = hashlib.sha256(data).hexdigest()
        dfd = open_dir(self.package_dir, self.rel_dir, create=True)
        try:
            if read_regular(digest, what="saved copy", dir_fd=dfd, shown=self.path(digest)) != data:
                tmp = write_temp(dfd, digest, data, None)
                os.replace(tmp, digest, src_dir_fd=dfd, dst_dir_fd=dfd)
                os.fsync(dfd)
        except OSError as exc:
            raise env_error("write", self.path(digest), exc) from None
        finally:
            os.close(dfd)
        return digest

    def load(self, digest: str) -> bytes:
        """The saved copy named `digest`, checked against its name."""
        if not NAME.match(digest):
            raise EnvironmentProblem(f"{digest!r} is not a saved-copy name; the record is damaged")
        dfd = open_dir_if_there(self.package_dir, self.rel_dir)
        data = None
        if dfd is not None:
            try:
                data = read_regular(digest, what="saved copy", dir_fd=dfd, shown=self.path(digest))
            finally:
                os.close(dfd)
        if data is None or hashlib.sha256(data).hexdigest() != digest:
            raise EnvironmentProblem(
                f"the saved copy {self.path(digest)} is missing or damaged; "
                "reinstall vLLM to get the original files back"
            )
        return data

    def names(self) -> list[str]:
        dfd = open_dir_if_there(self.package_dir, self.rel_dir)
        if dfd is None:
            return []
        try:
            return [
                e.name
                for e in os.scandir(dfd)
                if NAME.match(e.name) and e.is_file(follow_symlinks=False)
            ]
        finally:
            os.close(dfd)

    def prune(self, keep: set[str]) -> None:
        """Remove every saved copy not in `keep`: only blob-named regular files."""
        dfd = open_dir_if_there(self.package_dir, self.rel_dir)
        if dfd is None:
            return
        try:
            for entry in os.scandir(dfd):
                if entry.name in keep or not NAME.match(entry.name):
                    continue
                if entry.is_file(follow_symlinks=False):
                    os.unlink(entry.name, dir_fd=dfd)
        except OSError as exc:
            raise env_error("remove saved copies in", self.dir, exc) from None
        finally:
            os.close(dfd)
