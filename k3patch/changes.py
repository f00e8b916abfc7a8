"""What k3patch changed in a tree: the originals it recorded against the files as they are now.

`apply --check --diff` shows what an apply would write; on a tree that is already patched it
has nothing to show. An operator auditing a live container wants the other question answered:
what differs from the vLLM that was installed. The state record keeps the sha256 of every
original k3patch replaced and its bytes as a blob (for `revert`), so the answer is a unified
diff from each blob to the file now. Files k3patch never wrote are not in the record and never
appear; a file someone else changed after k3patch shows that change too, which is the point.
"""

from __future__ import annotations

import difflib

from k3patch import state
from k3patch.blobs import Blobs
from k3patch.tree import VllmTree


def _lines(data: bytes | None) -> list[str]:
    if data is None:
        return []
    return data.decode("utf-8", "replace").splitlines(keepends=True)


def recorded_diff(tree: VllmTree) -> str | None:
    """The unified diff from every recorded original to the file now: None when there is no
    state record (k3patch never changed this tree), "" when every recorded file holds its
    original again. Raises the record's own errors (damaged, other schema) and
    EnvironmentProblem for a missing or damaged saved original."""
    record = state.load(tree.state_dir, package_dir=tree.package_dir)
    if record is None:
        return None
    blobs = Blobs(tree.package_dir)
    chunks: list[str] = []
    for rel, recorded in sorted(record.files.items()):
        before = None if recorded.original is None else blobs.load(recorded.original)
        now = tree.read(rel)
        if before == now:
            continue
        old = _lines(before)
        new = _lines(now)
        for text in (old, new):
            if text and not text[-1].endswith("\n"):
                text[-1] += "\n\\ No newline at end of file\n"
        chunks.extend(
            difflib.unified_diff(
                old,
                new,
                fromfile=f"a/vllm/{rel}" if before is not None else "/dev/null",
                tofile=f"b/vllm/{rel}" if now is not None else "/dev/null",
            )
        )
    return "".join(chunks)
