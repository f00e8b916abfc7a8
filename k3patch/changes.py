"""What differs from the vLLM that was installed: a diff from each original k3patch saved (for
revert) to the file now, for auditing a patched tree, where `apply --check --diff` has nothing to
show. A change made by someone else after k3patch shows too, which is the point."""

from __future__ import annotations

import difflib

from k3patch import state
from k3patch.blobs import Blobs
from k3patch.tree import VllmTree


def _lines(data: bytes | None) -> list[str]:
    """The lines as `diff -u` shows them: a last line without its newline is marked."""
    lines = [] if data is None else data.decode("utf-8", "replace").splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n\\ No newline at end of file\n"
    return lines


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
        chunks.extend(
            difflib.unified_diff(
                _lines(before),
                _lines(now),
                fromfile=f"a/vllm/{rel}" if before is not None else "/dev/null",
                tofile=f"b/vllm/{rel}" if now is not None else "/dev/null",
            )
        )
    return "".join(chunks)
