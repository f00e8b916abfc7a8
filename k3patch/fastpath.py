"""The no-op path: `status` and `apply --quiet`/`--json` on a tree whose state record is fresh.

An entrypoint runs k3patch on every node and rank before `vllm serve`, and the tree is usually
already patched. Then the answer is in the state record: if every target file still hashes to
what the record saw, with the same patch code and k3patch version, the record's classification
stands. This module decides that with the standard library alone (no libcst, no typer, no rich,
not even the patch modules), and prints exactly what the full path would print. Any doubt (a
hash differs, a journal is present, an option it does not know) returns None and the full path
runs. What both paths print comes from the same bottom modules (formats.py: the JSON envelope
and report, the digests, the one-line verdicts; plaintext.py: the human report), so their
output cannot diverge.
"""

from __future__ import annotations

import os
import sys

from k3patch.formats import (
    _GOOD,
    STATE_SCHEMA_VERSION,
    _patch_set,
    envelope,
    file_sha256,
    load_json,
    quiet_line,
    read_plain,
    report_json,
    state_digest,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up cost)

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from typing import Any

    from k3patch.engine import ApplyOutcome
    from k3patch.tree import VllmTree


def apply_quiet_text(
    patch_ids: Sequence[str],
    results: Sequence[Mapping[str, Any]],
    recovered: Sequence[str],
    refused: Sequence[str] = (),
    all_or_nothing: bool = False,
) -> str:
    """`apply --quiet`: one line per patch (and per recovery step), for entrypoint logs."""
    lines = [f"k3patch: {quiet_line(patch_id, results)}" for patch_id in patch_ids]
    lines += [f"k3patch: recovered: {line}" for line in recovered]
    lines += [refused_line(refused, all_or_nothing)] if refused else []
    return _log_text(lines)


def _log_text(lines: Iterable[str]) -> str:
    from k3patch.plaintext import LOG_WIDTH, wrap

    return "".join(f"{out}\n" for text in lines for out in wrap(text, LOG_WIDTH))


def refused_line(refused: Sequence[str], all_or_nothing: bool) -> str:
    """The line that names the drifted patches an apply refused, and what it did instead."""
    rest = (
        "nothing was written (--all-or-nothing)"
        if all_or_nothing
        else "nothing of it was written (the other patches were not held back)"
    )
    return f"k3patch: refused: {', '.join(refused)} (drifted): {rest}"


# ------------------------------------------------------------------------------------------
# The fast path itself.


def _parse(argv: list[str]) -> dict[str, Any] | None:
    """The few options the no-op path serves; anything else returns None."""
    if not argv or argv[0] not in ("status", "apply"):
        return None
    opts: dict[str, Any] = {
        "command": argv[0],
        "only": [],
        "skip": [],
        "vllm": None,
        "lock_timeout": "120",
    }
    flags = {"--json": "json", "--quiet": "quiet", "-q": "quiet", "--sites": "sites"}
    if argv[0] == "status":
        flags["--digest"] = "digest"
    i = 1
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        if arg in flags:
            opts[flags[arg]] = True
        elif key in ("--vllm", "--only", "--skip", "--lock-timeout") and (eq or i + 1 < len(argv)):
            if not eq:
                i += 1
                value = argv[i]
            if key == "--vllm":
                opts["vllm"] = value
            elif key == "--lock-timeout":
                opts["lock_timeout"] = value
            elif key in ("--only", "--skip"):
                opts[key[2:]].append(value)
        else:
            return None
        i += 1
    if opts["command"] == "apply" and not (opts.get("quiet") or opts.get("json")):
        if sys.stdout.isatty():
            return None  # a terminal gets the coloured report of the full path
    return opts


def fresh_record(state_dir: str, package_dir: str) -> dict[str, Any] | None:
    """The state record, if it still describes every target file exactly; else None."""
    from k3patch import __version__

    try:
        return _fresh_record(state_dir, package_dir, __version__)
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return None  # any doubt: the full path looks at the code itself


def _fresh_record(state_dir: str, package_dir: str, version: str) -> dict[str, Any] | None:
    if os.path.lexists(os.path.join(state_dir, "journal.json")) or os.path.islink(state_dir):
        return None
    record = load_json(read_plain(os.path.join(state_dir, "state.json")))
    if (
        not isinstance(record, dict)
        or record.get("schema_version") != STATE_SCHEMA_VERSION
        or record.get("k3patch_version") != version
        or not _well_formed(record)
    ):
        return None
    import k3patch.patches

    patches_dir = os.path.dirname(k3patch.patches.__file__ or "")
    patch_set, targets = _patch_set(patches_dir)
    # The registry's targets, never the record's own list: a record whose scan omits a
    # target (copied from elsewhere, edited) must not vouch for a file it never hashed.
    if record["patch_set"] != patch_set or targets is None or set(record["scan"]) != targets:
        return None
    for rel in sorted(targets):
        if file_sha256(os.path.join(package_dir, rel)) != record["scan"][rel]:
            return None
    return record


def _well_formed(record: dict[str, Any]) -> bool:
    """Every field the fast path and the plugin read, of the type they read it as."""
    patches, results, scan = record.get("patches"), record.get("results"), record.get("scan")
    return (
        isinstance(record.get("patch_set"), str)
        and isinstance(scan, dict)
        and all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in scan.items())
        and isinstance(patches, list)
        and all(
            isinstance(p, dict)
            and all(isinstance(p.get(k), str) for k in ("id", "title", "caveat"))
            for p in patches
        )
        and isinstance(results, list)
        and all(
            isinstance(r, dict)
            and all(isinstance(r.get(k), str) for k in ("patch", "site", "file", "verdict"))
            and r["verdict"] in (*_GOOD, "pending", "drifted")
            and all(isinstance(r.get(k, ""), str) for k in ("shape", "detail"))
            for r in results
        )
    )


def apply_payload(outcome: ApplyOutcome) -> dict[str, Any]:
    """The JSON of `apply` (inside the envelope), for both paths."""
    payload = outcome.report.to_json()
    payload.update(
        check=outcome.check,
        refused=outcome.refused,
        refused_patches=outcome.refused_patches,
        all_or_nothing=outcome.all_or_nothing,
        written=[f"vllm/{rel}" for rel in outcome.written],
        recovered=outcome.recovered,
        bytecode=outcome.pycache,
    )
    return payload


def _apply_lean(tree: VllmTree, opts: dict[str, Any]) -> int:
    """`apply --quiet` or `apply --json` with work to do, straight into the engine: an
    entrypoint's cold start needs no option parser or terminal renderer, only plain lines or
    JSON, the same as the full CLI prints."""
    from k3patch import engine, exitcodes, registry

    try:
        patches = registry.select(opts["only"] or None, opts["skip"] or None)
        outcome = engine.apply(tree, patches, lock_timeout=float(opts["lock_timeout"]))
    except Exception as exc:
        if os.environ.get("K3PATCH_DEBUG"):
            raise
        code, message = int(exitcodes.for_exception(exc)), exitcodes.describe(exc)
        if opts.get("json"):
            sys.stdout.write(envelope("apply", code, {"error": message}))
        else:
            sys.stderr.write(f"k3patch: error: {message}\n")
        return code
    code = int(exitcodes.for_apply(outcome))
    if opts.get("json"):
        sys.stdout.write(envelope("apply", code, apply_payload(outcome)))
    elif not opts.get("quiet"):
        sys.stdout.write(_apply_human_text(outcome, opts.get("sites", False)))
    else:
        results = [r.to_json() for r in outcome.report.results]
        sys.stdout.write(
            apply_quiet_text(
                [p.id for p in patches],
                results,
                outcome.recovered,
                outcome.refused_patches,
                outcome.all_or_nothing,
            )
        )
    sys.stdout.flush()
    return code


def _apply_human_text(outcome: ApplyOutcome, every_site: bool) -> str:
    """`apply` in a log: the same lines the full path prints (`plaintext.apply_lines`)."""
    from k3patch import plaintext
    from k3patch.engine import patch_meta

    report = outcome.report
    before = outcome.plan.before.results if outcome.plan is not None else []
    lines = plaintext.apply_lines(
        report.vllm_info,
        patch_meta(report.patches),
        [r.to_json() for r in report.results],
        before=[r.to_json() for r in before],
        written=outcome.written,
        bytecode=outcome.pycache,
        recovered=outcome.recovered,
        refused=outcome.refused_patches,
        refused_text=refused_line(outcome.refused_patches, outcome.all_or_nothing).removeprefix(
            "k3patch: refused: "
        ),
        all_or_nothing=outcome.all_or_nothing,
        every_site=every_site,
    )
    return plaintext.as_text(lines)


def try_fast(argv: list[str]) -> int | None:
    """Serve the command from the state record, or return None to let the full path run.
    Output that fails after the outcome is known (a closed pipe, a full disk) keeps its code."""
    from k3patch import exitcodes

    exitcodes.decided.clear()
    try:
        return _try_fast(argv)
    except OSError as exc:
        if exitcodes.decided:
            return exitcodes.output_failed(exc)
        raise


def _try_fast(argv: list[str]) -> int | None:
    """Serve the command from the state record, or return None to let the full path run."""
    opts = _parse(argv)
    if opts is None:
        return None
    from k3patch.tree import TreeError, locate

    try:
        tree = locate(opts["vllm"])
    except TreeError:
        return None  # the full path reports it
    state_dir, package_dir = tree.state, tree.package
    record = fresh_record(state_dir, package_dir)
    if record is None:
        if opts["command"] != "apply":
            return None
        # Concurrent entrypoints: wait for a run in progress here, asleep, then look again. If
        # there is still work, keep the lock: the full path runs under it in this process.
        from k3patch import lock

        try:
            timeout = float(opts["lock_timeout"])
            if not lock.hold_or_wait(state_dir, timeout):
                record = fresh_record(state_dir, package_dir)
                if record is None:
                    lock.hold(state_dir, timeout)  # the other run left work: do it ourselves
        except lock._Busy as exc:
            # The one timeout is spent: the full path must not wait a second time.
            if opts.get("json"):
                sys.stdout.write(envelope("apply", 3, {"error": str(exc)}))
            else:
                sys.stderr.write(f"k3patch: error: {exc}\n")
            return 3
        except (lock.EnvironmentProblem, ValueError):
            return None
        if record is None:
            record = fresh_record(state_dir, package_dir)
        if record is None:
            return _apply_lean(tree, opts)
    scan: dict[str, str | None] = record["scan"]
    known = [p["id"] for p in record["patches"]]
    if any(p not in known for p in opts["only"] + opts["skip"]):
        return None
    patches = [
        p
        for p in record["patches"]
        if (not opts["only"] or p["id"] in opts["only"]) and p["id"] not in opts["skip"]
    ]
    wanted = {p["id"] for p in patches}
    results = [r for r in record["results"] if r["patch"] in wanted]
    verdicts = [r["verdict"] for r in results]
    if "drifted" in verdicts:
        return None  # drift reports carry details only the full path renders
    from k3patch import exitcodes
    from k3patch.exitcodes import code_for_verdicts

    code = int(code_for_verdicts(verdicts, interrupted=False))
    exitcodes.decided.append(code)
    if opts["command"] == "apply" and code != 0:
        return None  # something to do: the full path does it
    vllm = {
        "package_dir": package_dir,
        "kind": tree.kind,
        "version": tree.version,
        "version_source": tree.version_source,
    }
    digest = state_digest(tree.version, scan, results)
    out = sys.stdout
    if opts.get("json"):
        payload = report_json(vllm, digest, True, None, patches, results)
        if opts["command"] == "apply":
            payload.update(
                check=False,
                refused=False,
                refused_patches=[],
                all_or_nothing=False,
                written=[],
                recovered=[],
                bytecode=[],
            )
        out.write(envelope(opts["command"], code, payload))
    elif opts.get("digest"):
        out.write(digest + "\n")
    elif opts["command"] == "apply" and opts.get("quiet"):
        out.write(apply_quiet_text([p["id"] for p in patches], results, []))
    elif opts.get("quiet"):
        out.write(_log_text(quiet_line(p["id"], results) for p in patches))
    elif out.isatty():
        return None  # an interactive terminal gets the coloured report of the full path
    else:
        from k3patch import plaintext

        every_site = opts.get("sites", False)
        if opts["command"] == "apply":
            lines = plaintext.apply_lines(vllm, patches, results, every_site=every_site)
        else:
            lines = plaintext.status_lines(
                vllm, patches, results, digest, True, every_site=every_site
            )
        out.write(plaintext.as_text(lines))
    out.flush()
    return code
