"""The human report as plain lines, for both paths (the no-op path and the full CLI's `render`):
standard library only, from the JSON-shaped dicts both have. Logs get `LOG_WIDTH` columns
(`docker logs` and `kubectl logs` show long lines badly); a word, a path, is never split.
"""

from __future__ import annotations

import re
import sys
from typing import TYPE_CHECKING

from k3patch.formats import quiet_line
from k3patch.verdicts import GOOD

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from typing import Any

    # A line before wrapping: text, hanging indent (negative: code, see `code`), a style key
    # (a verdict or "error", "ok", ...; "" for none) and the styled span, which `render` colours.
    Line = tuple[str, int, str, int, int]

LOG_WIDTH = 100
VERDICT_WIDTH = len("not applicable")

# Every control character but the tab (C0, DEL, C1, and the Unicode line and paragraph
# separators) as its escape: a newline in a path must not start a line of its own.
_CONTROLS = {
    c: repr(chr(c))[1:-1] for c in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029] if c != 0x09
}


# Stands for a space inside a path while a line is wrapped (`whole`), then is a space again.
_PATH_SPACE = "\ue000"


def whole(path: str) -> str:
    """`path` as one word for `wrap`: a path is never broken at a space in it."""
    return path.replace(" ", _PATH_SPACE)


def line(text: str, hang: int = 4, style: str = "", start: int = 0, end: int = 0) -> Line:
    return (text.translate(_CONTROLS), hang, style, start, end)


def code(text: str, margin: int = 6) -> list[Line]:
    """Source code as a preformatted block, `margin` columns in, its own indentation kept (tabs
    expanded as Python reads them), blank lines too: never reflowed, cut when too long."""
    return [
        line((" " * margin + src.expandtabs(8)).rstrip(), -1 - margin) for src in text.splitlines()
    ]


def _cut(text: str, width: int, margin: int) -> list[str]:
    """A code line cut to `width` columns: every piece but the last ends in `\\` (the mark of a
    cut line), and each piece after the first starts at the block's `margin`."""
    step = max(width - 1 - margin, 8)
    out = [text[: width - 1] + "\\"] if len(text) > width else [text]
    rest = text[width - 1 :] if len(text) > width else ""
    while rest:
        piece, rest = rest[:step], rest[step:]
        out.append(" " * margin + piece + ("\\" if rest else ""))
    return out


def wrap(text: str, width: int, hang: int = 4) -> list[str]:
    """Break `text` on spaces into lines of at most `width` columns, continuation lines indented
    by `hang`. A word is never split: a line's indent shrinks so that its first word fits, and a
    word longer than the width stands whole on its own line. A negative `hang` is code: cut."""
    if hang < 0:
        return [cut.replace(_PATH_SPACE, " ") for cut in _cut(text, width, -1 - hang)]
    if len(text) <= width:
        return [text.replace(_PATH_SPACE, " ")]
    lines: list[str] = []
    current = ""
    for chunk in re.findall(r" *[^ ]+| +", text):  # each: its leading spaces and one word
        if current.strip() and len(current) + len(chunk) > width:
            lines.append(current.rstrip())
            word = chunk.lstrip(" ")
            current = " " * max(0, min(hang, width - len(word))) + word
        else:
            current += chunk
    lines.append(current.rstrip())
    stripped = lines[0].lstrip(" ")
    if len(lines[0]) > width and len(stripped) <= width:
        lines[0] = " " * (width - len(stripped)) + stripped
    return [out.replace(_PATH_SPACE, " ") for out in lines]


def as_text(lines: Iterable[Line], width: int = LOG_WIDTH) -> str:
    return "".join(f"{out}\n" for item in lines for out in wrap(item[0], width, item[1]))


def header(vllm: Mapping[str, Any]) -> Line:
    version = vllm["version"] or "unknown version"
    where = f"({vllm['kind']}, version from {vllm['version_source']}) at "
    where += whole(vllm["package_dir"])
    return line(f"vLLM {version} {where}", 2)


def error(label: str, rest: str = "") -> Line:
    """A line that opens with an error word (`label`), coloured on a terminal."""
    return line(label + rest, 2, "error", 0, len(label))


def error_text(message: str, prefix: str = "k3patch: error:") -> str:
    """An error as a log gets it: one line however long, a control character (a newline in a
    path) escaped. render.error_line prints the same line, coloured on a terminal."""
    return as_text([error(prefix, f" {message}")], sys.maxsize)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(i for i in items if i))


def patch_line(patch_id: str, verdict: str, summary: str, id_width: int) -> Line:
    start = id_width + 2
    text = f"{patch_id.ljust(id_width)}  {verdict.ljust(VERDICT_WIDTH)}  {summary}".rstrip()
    return line(text, start + VERDICT_WIDTH + 2, verdict, start, start + len(verdict))


def site_lines(site: Mapping[str, Any]) -> list[Line]:
    verdict = site["verdict"]
    name = f"  {site['site']}: "
    out = [line(f"{name}{verdict}", 6, verdict, len(name), len(name) + len(verdict))]
    where = f":{site['line']}" if site.get("line") else ""
    out.append(line(f"    vllm/{site['file']}{where}", 6))
    reason = ": ".join(p for p in (site.get("shape", ""), site.get("detail", "")) if p)
    if reason:
        out.append(line(f"    {reason}", 6))
    if site.get("found"):
        out.append(line("    found:", 6))
        out += code(site["found"])
    if site.get("expected"):
        out.append(line("    expected one of:", 6))
        for shape in site["expected"]:
            out += code(shape)
    return out


def patches_block(
    report: Mapping[str, Any], every_site: bool, summaries: Mapping[str, str]
) -> list[Line]:
    """One line per patch (its summary: `summaries`' or the shapes its sites matched, else the
    first reason); under it each site not in a good state (every site with `every_site`)."""
    id_width = max([len(p["id"]) for p in report["patches"]] or [0])
    out: list[Line] = []
    for patch in report["patches"]:
        sites = patch["sites"]
        summary = summaries.get(patch["id"]) or "; ".join(
            _unique(s.get("shape", "") for s in sites)
            or _unique(s.get("detail", "") for s in sites)[:1]
        )
        out.append(patch_line(patch["id"], patch["verdict"], summary, id_width))
        for site in sites:
            if every_site or site["verdict"] not in GOOD:
                out += site_lines(site)
    return out


def interrupted(op: str, then: str) -> Line:
    """The error line for a journal an interrupted run left, and what comes of it."""
    return error(f"an interrupted k3patch {op} left a journal", f"; {then}")


def status_lines(report: Mapping[str, Any], *, every_site: bool = False) -> list[Line]:
    """`status` from its JSON (`formats.report_json`)."""
    out = [header(report["vllm"]), *patches_block(report, every_site, {}), *_journal(report)]
    digest = f"digest {report['digest']}"
    return [*out, line(digest + ("  (from the state record)" if report["from_record"] else ""))]


def _journal(report: Mapping[str, Any]) -> list[Line]:
    """The line of an interrupted run's journal that `status` found, if any."""
    then = "the next apply or revert rolls it back first"
    return [interrupted(report["interrupted"], then)] if report["interrupted"] else []


def quiet_lines(report: Mapping[str, Any]) -> list[Line]:
    """`status --quiet`: one line per patch, `k3patch: id: verdict`, as `apply --quiet` prints
    it (one format for logs, README), and the journal line: the exit 1 it causes is named."""
    out = [line("k3patch: " + quiet_line(p["id"], p["sites"])) for p in report["patches"]]
    return out + _journal(report)


def _refusals(report: Mapping[str, Any]) -> list[str]:
    """What follows "refused: " for each patch an apply refused: drifted, or a k3patch bug."""
    out = [
        f"{patch_id} (a k3patch bug: its rewrite failed its own checks; nothing of it was "
        f"written, report it): {why}"
        for patch_id, why in report.get("bugs", {}).items()
    ]
    if report["refused_patches"]:
        rest = (
            "nothing was written (--all-or-nothing)"
            if report["all_or_nothing"]
            else "nothing of it was written (the other patches were not held back)"
        )
        out.insert(0, f"{', '.join(report['refused_patches'])} (drifted): {rest}")
    return out


def apply_quiet_lines(report: Mapping[str, Any]) -> list[Line]:
    """`apply --quiet` from its JSON: one line per patch, recovery step and refusal, for logs."""
    out = quiet_lines(report)
    out += [line(f"k3patch: recovered: {step}") for step in report["recovered"]]
    return out + [line(f"k3patch: refused: {text}") for text in _refusals(report)]


def files_lines(title: str, files: Sequence[str], bytecode: Sequence[str]) -> list[Line]:
    """The files an apply wrote or a revert restored, in full, and what was done to bytecode."""
    out = [line(title), *(line(f"  {path}") for path in files)]
    return out + [line(f"bytecode: {step}") for step in bytecode]


def apply_lines(
    report: Mapping[str, Any],
    *,
    before: Sequence[Mapping[str, Any]] = (),
    every_site: bool = False,
) -> list[Line]:
    """`apply` from its JSON: per patch its verdict now and, for a patch this run wrote, the
    shape it was in (`before`, the sites as the run found them) and the files it changed; then
    the refusals and the files written."""
    written, bugs = report["written"], report.get("bugs", {})
    summaries: dict[str, str] = {}
    for patch in report["patches"]:
        was = [r for r in before if r["patch"] == patch["id"] and r["verdict"] == "pending"]
        files = _unique(r["file"] for r in was if f"vllm/{r['file']}" in written)
        if files:
            shapes = "; ".join(_unique(r.get("shape", "") for r in was))
            names = ", ".join(f.rsplit("/", 1)[-1] for f in files)
            summaries[patch["id"]] = (f"was {shapes}; " if shapes else "") + f"wrote {names}"
    out = [header(report["vllm"]), *patches_block(report, every_site, summaries)]
    out += [line(f"recovered: {step}") for step in report["recovered"]]
    out += [error("refused:", f" {text}") for text in _refusals(report)]
    if bugs and report["all_or_nothing"] and not report["refused_patches"]:
        out.append(line("nothing was written (--all-or-nothing)"))
    held = set(report["refused_patches"]) | set(bugs)
    sites = [s for p in report["patches"] for s in p["sites"]]
    pending = sorted({s["patch"] for s in sites if s["verdict"] == "pending"} - held)
    if report["check"] and pending and not report["all_or_nothing"]:
        out.append(line("would apply: " + ", ".join(pending) + " (--check: nothing written)"))
    elif written:  # never under --check
        out += files_lines("wrote:", written, report["bytecode"])
    elif report["bytecode"]:  # bytecode Python ran instead of the source, removed
        out += [line(f"bytecode: {step}") for step in report["bytecode"]]
    elif not held:
        out.append(line("nothing to do"))
    return out


def list_lines(patches: Sequence[Mapping[str, Any]]) -> list[Line]:
    id_width = max([len(p["id"]) for p in patches] or [0])
    out: list[Line] = []
    for p in patches:
        out.append(line(f"{p['id'].ljust(id_width)}  {p['title']}", id_width + 2))
        out.append(line("  files (under vllm/): " + ", ".join(p["files"]), 4))
        if p.get("caveat"):
            out.append(line(f"  not covered: {p['caveat']}", 4))
    return out
