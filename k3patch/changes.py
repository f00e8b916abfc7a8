"""What differs from the vLLM that was installed: a diff from each original k3patch saved (for
revert) to the file now, for auditing a patched tree, where `apply --check --diff` has nothing to
show. A change made by someone else after k3patch shows too, which is the point."""

from __future__ import annotations

import difflib

from k3patch import state
from k3patch.transaction import Transaction, moves_only_sites, sha256
from k3patch.tree import VllmTree


def file_diff(rel: str, before: str | bytes | None, now: str | bytes | None) -> list[str]:
    """One file's unified diff as `diff -u` prints it: a last line without its newline is
    marked (else the next file's header would run onto it), an absent side is /dev/null. Both
    `status --diff` and `apply --diff` print through here."""

    def lines(data: str | bytes | None) -> list[str]:
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data or ""
        # Lines as `patch` and `diff` count them: ended by "\n" alone, never by a form feed
        # or another character str.splitlines() also breaks at.
        *found, last = [f"{piece}\n" for piece in text.split("\n")]
        if last != "\n":
            found.append(last + "\\ No newline at end of file\n")
        return found

    return list(
        difflib.unified_diff(
            lines(before),
            lines(now),
            fromfile=f"a/vllm/{rel}" if before is not None else "/dev/null",
            tofile=f"b/vllm/{rel}" if now is not None else "/dev/null",
        )
    )


def recorded_diff(tree: VllmTree) -> str | None:
    """The unified diff from every recorded original to the file now: None when there is no
    state record (k3patch never changed this tree), "" when every recorded file holds its
    original again. Raises the record's own errors (damaged, other schema) and
    EnvironmentProblem for a missing or damaged saved original. Each original is checked as
    revert checks it before writing it back, so a diff is never from bytes that are not one."""
    record = state.load(tree.state_dir, package_dir=tree.package_dir)
    if record is None:
        return None
    txn = Transaction(tree.package_dir)
    where = str(tree.state_dir / state.STATE_FILE)
    if why := txn.unnamed_original(record):
        raise state.damaged(where, why)
    images = []
    for rel, recorded in sorted(record.files.items()):
        before = None if recorded.original is None else txn.blobs.load(recorded.original)
        images.append((rel, tree.read(rel), before))
    # What k3patch wrote binds to its original by its sites (a file edited since cannot).
    held = [i for i in images if i[1] and sha256(i[1]) == record.files[i[0]].applied]
    if why := moves_only_sites(tree.package_dir, held):
        raise state.damaged(where, f"an original it names does not belong to its file ({why})")
    return "".join(
        "".join(file_diff(rel, before, now)) for rel, now, before in images if before != now
    )
