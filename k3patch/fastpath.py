"""The no-op path: `status` and `apply` on a tree whose state record is fresh.

An entrypoint runs k3patch on every node and rank before `vllm serve`, and the tree is usually
already patched. Then the answer is in the state record: `state.fresh_record` (the same question
the engine asks) says whether every registered target still hashes to what the record saw, with
the same patch code and k3patch version. If so, this module prints what the full path would
print, without importing typer, rich, libcst or a patch module, and without classifying.

It serves only the command forms it understands completely (`parse`); anything else, or any
doubt (a hash differs, a journal is there, a drifted site whose report needs the full path),
returns None and the full CLI runs. What it prints comes from the modules both paths print
with: formats (the JSON, the one-line verdicts, the digest), plaintext (the human report) and
the two helpers here that the CLI's renderer calls too.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from k3patch import exitcodes, formats, lock, plaintext, state
from k3patch.errors import EnvironmentProblem, TreeError
from k3patch.tree import locate

if TYPE_CHECKING:
    from k3patch.engine import ApplyOutcome


def apply_quiet_text(
    patch_ids: Sequence[str],
    results: Sequence[dict[str, Any]],
    recovered: Sequence[str],
    refused: Sequence[str] = (),
    all_or_nothing: bool = False,
) -> str:
    """`apply --quiet`: one line per patch (and per recovery step), for entrypoint logs."""
    lines = [f"k3patch: {formats.quiet_line(patch_id, results)}" for patch_id in patch_ids]
    lines += [f"k3patch: recovered: {line}" for line in recovered]
    lines += [refused_line(refused, all_or_nothing)] if refused else []
    return "".join(
        f"{out}\n" for text in lines for out in plaintext.wrap(text, plaintext.LOG_WIDTH)
    )


def refused_line(refused: Sequence[str], all_or_nothing: bool) -> str:
    """The line that names the drifted patches an apply refused, and what it did instead."""
    rest = (
        "nothing was written (--all-or-nothing)"
        if all_or_nothing
        else "nothing of it was written (the other patches were not held back)"
    )
    return f"k3patch: refused: {', '.join(refused)} (drifted): {rest}"


def apply_payload(outcome: ApplyOutcome) -> dict[str, Any]:
    """The JSON of `apply` (inside the envelope) of the full path."""
    payload = outcome.report.to_json()
    payload.update(
        formats.apply_fields(
            check=outcome.check,
            refused=outcome.refused,
            refused_patches=outcome.refused_patches,
            all_or_nothing=outcome.all_or_nothing,
            written=outcome.written,
            recovered=outcome.recovered,
            bytecode=outcome.pycache,
        )
    )
    return payload


# ------------------------------------------------------------------------------------------
# The command forms served: what the CLI accepts for these options, parsed as click parses them
# (`--opt value` or `--opt=value`; --only/--skip repeatable; the last --vllm/--lock-timeout
# wins). --diff, --check, --all-or-nothing, --help, `--` and anything unknown are not served.

_COMMON = {"--json": "json", "--quiet": "quiet", "-q": "quiet", "--sites": "sites"}
_FLAGS = {"status": {**_COMMON, "--digest": "digest"}, "apply": _COMMON}
_VALUES = {
    "status": ("--vllm", "--only", "--skip"),
    "apply": ("--vllm", "--only", "--skip", "--lock-timeout"),
}


def parse(argv: Sequence[str]) -> dict[str, Any] | None:
    """The command form `argv` asks for, or None when the no-op path does not serve it."""
    if not argv or argv[0] not in _FLAGS:
        return None
    command = argv[0]
    form: dict[str, Any] = {"command": command, "vllm": None, "only": [], "skip": []}
    form["lock_timeout"] = "120"  # the CLI's default
    rest = list(argv[1:])
    while rest:
        arg = rest.pop(0)
        if arg in _FLAGS[command]:
            form[_FLAGS[command][arg]] = True
            continue
        name, eq, value = arg.partition("=")
        if name not in _VALUES[command] or not (eq or rest):
            return None
        value = value if eq else rest.pop(0)
        if not value or value.startswith("-"):
            return None  # what click makes of these is the full path's to say
        if name in ("--only", "--skip"):
            form[name[2:]].append(value)
        else:
            form[name[2:].replace("-", "_")] = value
    try:
        timeout = float(form["lock_timeout"])  # click's FLOAT; the engine then checks the range
    except ValueError:
        return None
    if not math.isfinite(timeout) or timeout < 0:
        return None
    form["lock_timeout"] = timeout
    return form


def try_fast(argv: list[str]) -> int | None:
    """Serve the command from the state record, or return None to let the full path run.
    Output that fails after the outcome is known (a closed pipe, a full disk) keeps its code."""
    exitcodes.decided.clear()
    try:
        return _try_fast(argv)
    except OSError as exc:
        if exitcodes.decided:
            return exitcodes.output_failed(exc)
        raise


def _try_fast(argv: list[str]) -> int | None:
    form = parse(argv)
    if form is None:
        return None
    out = sys.stdout
    # A terminal gets the full path's report, wrapped to its width and coloured.
    if out.isatty() and not (form.get("json") or form.get("digest")):
        if not (form["command"] == "apply" and form.get("quiet")):
            return None
    try:
        tree = locate(form["vllm"])
    except TreeError:
        return None  # the full path reports it
    record = state.fresh_record(tree.package)
    if record is None and form["command"] == "apply":
        # Concurrent entrypoints: wait, asleep, for a run in progress, then look again. If
        # there is still work, keep the lock: the full path runs under it in this process.
        try:
            if not lock.hold_or_wait(tree.package, form["lock_timeout"]):
                record = state.fresh_record(tree.package)
                if record is None:
                    lock.hold(tree.package, form["lock_timeout"])  # it left work: ours to do
            else:
                record = state.fresh_record(tree.package)  # it may have finished meanwhile
        except lock.Busy as exc:
            # The one timeout is spent: the full path must not wait a second time.
            if form.get("json"):
                out.write(formats.envelope("apply", 3, {"error": str(exc)}))
            else:
                sys.stderr.write(f"k3patch: error: {exc}\n")
            return 3
        except EnvironmentProblem:
            return None
    if record is None:
        return None
    known = [p["id"] for p in record.patches]
    if any(p not in known for p in form["only"] + form["skip"]):
        return None  # the full path names the unknown patch
    patches = [
        p
        for p in record.patches
        if (not form["only"] or p["id"] in form["only"]) and p["id"] not in form["skip"]
    ]
    wanted = {p["id"] for p in patches}
    results = [r.to_json() for r in record.results if r.patch_id in wanted]
    verdicts = [r["verdict"] for r in results]
    if "drifted" in verdicts:
        return None  # drift reports carry details only the full path renders
    code = int(exitcodes.code_for_verdicts(verdicts, interrupted=False))
    if form["command"] == "apply" and code != 0:
        return None  # something to do: the full path does it
    exitcodes.decided.append(code)
    digest = formats.state_digest(tree.version, record.scan, results)
    if form.get("json"):
        payload = formats.report_json(tree.info, digest, True, None, patches, results)
        if form["command"] == "apply":
            payload.update(formats.apply_fields())
        out.write(formats.envelope(form["command"], code, payload))
    elif form.get("digest"):
        out.write(digest + "\n")
    elif form["command"] == "apply" and form.get("quiet"):
        out.write(apply_quiet_text([p["id"] for p in patches], results, []))
    elif form.get("quiet"):
        lines = [plaintext.line(formats.quiet_line(p["id"], results)) for p in patches]
        out.write(plaintext.as_text(lines))
    elif form["command"] == "apply":
        every_site = form.get("sites", False)
        out.write(
            plaintext.as_text(
                plaintext.apply_lines(tree.info, patches, results, every_site=every_site)
            )
        )
    else:
        every_site = form.get("sites", False)
        lines = plaintext.status_lines(
            tree.info, patches, results, digest, True, every_site=every_site
        )
        out.write(plaintext.as_text(lines))
    out.flush()
    return code
