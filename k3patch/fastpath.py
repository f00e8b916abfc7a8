"""The no-op path: `status` and `apply` on a tree whose state record is fresh (an entrypoint
runs k3patch on every rank, and the tree is usually patched already). When `state.fresh_record`
says every target still hashes as the record saw, this prints what the full path would, through
the same `formats` and `plaintext`, without typer, rich, libcst, a patch module or classifying.
Any form `parse` does not serve, and any doubt, returns None: the full CLI runs.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from k3patch import exitcodes, formats, lock, plaintext, state
from k3patch.errors import EnvironmentProblem, TreeError
from k3patch.tree import locate

# The command forms served: what the CLI accepts for these options, parsed as click parses them
# (`--opt value` or `--opt=value`; --only/--skip repeatable; the last --vllm/--lock-timeout
# wins). --diff, --check, --all-or-nothing, --help, `--` and anything unknown are not served.

_COMMON = {"--json": "json", "--quiet": "quiet", "-q": "quiet", "--sites": "sites"}
_FLAGS = {"status": {**_COMMON, "--digest": "digest"}, "apply": _COMMON}
_VALUES = {
    "status": ("--vllm", "--only", "--skip", "--lock-timeout"),
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
    forms = [name for name in ("json", "quiet", "digest", "sites") if form.get(name)]
    if "json" in forms and "sites" in forms:
        forms.remove("sites")  # --json carries every site
    if len(forms) > 1:
        return None  # two output forms at once: the CLI's usage error (cli._FORMS)
    if set(form["only"]) & set(form["skip"]):
        return None  # a patch both selected and skipped: the CLI's usage error (registry.select)
    try:
        form["lock_timeout"] = lock.parse_timeout(form["lock_timeout"])  # the CLI's parser
    except ValueError:
        return None  # the CLI's refusal
    return form


def try_fast(argv: list[str]) -> int | None:
    """Serve the command from the state record, or return None to let the full path run."""
    form = parse(argv)
    if form is None:
        return None
    out, command = sys.stdout, form["command"]
    # A terminal gets the full path's report, wrapped to its width and coloured.
    if out.isatty() and not (form.get("json") or form.get("digest")):
        if not (command == "apply" and form.get("quiet")):
            return None
    try:
        tree = locate(form["vllm"])
    except TreeError:
        return None  # the full path reports it
    record = state.fresh_record(tree.package)
    if record is None and command == "apply":
        # Concurrent entrypoints: wait, asleep, for a run in progress, then look again. If
        # there is still work, keep the lock: the full path runs under it in this process.
        try:
            holding = lock.hold_or_wait(tree.package, form["lock_timeout"])
            record = state.fresh_record(tree.package)  # the other run may have finished
            if record is None and not holding:
                lock.hold(tree.package, form["lock_timeout"])  # it left work: ours to do
        except lock.Busy as exc:
            # The one timeout is spent: the full path must not wait a second time. What it
            # would print: under --json the envelope, and the error line either way.
            if form.get("json"):
                out.write(formats.envelope("apply", 3, {"error": str(exc)}))
            sys.stderr.write(plaintext.error_text(str(exc)))
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
    code = exitcodes.code_for_verdicts(verdicts, interrupted=False)
    if command == "apply" and code != 0:
        return None  # something to do: the full path does it
    digest = formats.state_digest(tree.version, record.scan, results)
    payload = formats.report_json(tree.info, digest, True, None, patches, results)
    if command == "apply":
        payload.update(formats.apply_fields())
    if form.get("json"):
        text = formats.envelope(command, code, payload)
    elif form.get("digest"):
        text = digest + "\n"
    elif form.get("quiet"):
        quiet = plaintext.apply_quiet_lines if command == "apply" else plaintext.quiet_lines
        text = plaintext.as_text(quiet(payload))
    else:
        full = plaintext.apply_lines if command == "apply" else plaintext.status_lines
        text = plaintext.as_text(full(payload, every_site=form.get("sites", False)))
    out.write(text)
    out.flush()
    return code
