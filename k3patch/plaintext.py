"""The human report as plain lines: one line per patch, details only where a site needs a look.

Both paths print through this module (the no-op path in `fastpath`, the full CLI in `render`),
so it takes the JSON-shaped dicts both have and uses the standard library only (the no-op path
must not pay for typer, rich or libcst). A line is built once, unwrapped, with a hanging indent
and the span of its verdict word; `wrapped` breaks it for a given width.

Logs (not a terminal) get `LOG_WIDTH`: `docker logs` and `kubectl logs` show long lines badly.
Words are never split, so a path longer than the width stays whole on a line of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3patch.verdicts import GOOD
from k3patch.verdicts import summary as summary_verdict

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence
    from typing import Any

    # One line of the report before wrapping: its text, the hanging indent of its continuation
    # lines, a style key ("" for none) and the start and end of the styled span in the text.
    # The style keys are verdicts and a few words ("error", "ok", "failed"); `render` maps them
    # to colours on a terminal.
    Line = tuple[str, int, str, int, int]

LOG_WIDTH = 100
VERDICT_WIDTH = len("not applicable")


# Every control character but the tab (C0, DEL, C1, and the Unicode line and paragraph
# separators) as its escape: a newline in a path must not start a line of its own.
_CONTROLS = {
    c: repr(chr(c))[1:-1] for c in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029] if c != 0x09
}


def escape_controls(text: str) -> str:
    """`text` with every control character but the tab shown escaped (`\\n`, `\\x1b`)."""
    return text.translate(_CONTROLS)


def line(text: str, hang: int = 4, style: str = "", start: int = 0, end: int = 0) -> Line:
    return (escape_controls(text), hang, style, start, end)


def _chunks(text: str) -> list[str]:
    """`text` cut before every run of spaces: each chunk is its leading spaces plus one word."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        j = i
        while j < n and text[j] == " ":
            j += 1
        k = j
        while k < n and text[k] != " ":
            k += 1
        out.append(text[i:k])
        i = k
    return out


def code(text: str, margin: int = 6) -> list[Line]:
    """Source code as a preformatted block: each of its lines a line of the report, `margin`
    columns in, its own indentation kept (tabs expanded as Python reads them), blank lines too.
    Such a line is never reflowed as prose; one longer than the width is cut (see `_cut`)."""
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
    word longer than the width stands whole on its own line. A negative `hang` marks a line of
    code (`code`): cut, never reflowed."""
    if hang < 0:
        return _cut(text, width, -1 - hang)
    if len(text) <= width:
        return [text]
    chunks = _chunks(text)
    lines: list[str] = []
    current = ""
    for chunk in chunks:
        if current.strip() and len(current) + len(chunk) > width:
            lines.append(current.rstrip())
            word = chunk.lstrip(" ")
            current = " " * max(0, min(hang, width - len(word))) + word
        else:
            current += chunk
    lines.append(current.rstrip())
    first = lines[0]
    stripped = first.lstrip(" ")
    if len(first) > width and len(stripped) <= width:
        lines[0] = " " * (width - len(stripped)) + stripped
    return lines


def wrapped(lines: Iterable[Line], width: int) -> list[str]:
    return [out for item in lines for out in wrap(item[0], width, item[1])]


def as_text(lines: Iterable[Line], width: int = LOG_WIDTH) -> str:
    return "".join(f"{out}\n" for out in wrapped(lines, width))


# ------------------------------------------------------------------------------------------
# Pieces of every report.


def header(vllm: Mapping[str, Any]) -> Line:
    version = vllm["version"] or "unknown version"
    return line(
        f"vLLM {version} ({vllm['kind']}, version from {vllm['version_source']}) at "
        f"{vllm['package_dir']}",
        2,
    )


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(i for i in items if i))


def patch_summary(sites: Sequence[Mapping[str, Any]]) -> str:
    """What a patch's sites are: the shapes they matched, or the first reason when none did."""
    shapes = _unique(s.get("shape", "") for s in sites)
    if shapes:
        return "; ".join(shapes)
    details = _unique(s.get("detail", "") for s in sites)
    return details[0] if details else ""


def patch_line(patch_id: str, verdict: str, summary: str, id_width: int) -> Line:
    start = id_width + 2
    text = f"{patch_id.ljust(id_width)}  {verdict.ljust(VERDICT_WIDTH)}  {summary}".rstrip()
    return line(text, start + VERDICT_WIDTH + 2, verdict, start, start + len(verdict))


def site_lines(site: Mapping[str, Any]) -> list[Line]:
    """A site's details: name and verdict, file:line, shape and reason, and for a drifted site
    the code found and the shapes expected."""
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
    patches: Sequence[Mapping[str, Any]],
    results: Sequence[Mapping[str, Any]],
    *,
    every_site: bool = False,
    summaries: Mapping[str, str] | None = None,
) -> list[Line]:
    """One line per patch; under it the details of each site not in a good state (of every
    site with `every_site`)."""
    id_width = max([len(p["id"]) for p in patches] or [0])
    out: list[Line] = []
    for patch in patches:
        sites = [r for r in results if r["patch"] == patch["id"]]
        verdict = summary_verdict(r["verdict"] for r in sites)
        summary = (summaries or {}).get(patch["id"]) or patch_summary(sites)
        out.append(patch_line(patch["id"], verdict, summary, id_width))
        for site in sites:
            if every_site or site["verdict"] not in GOOD:
                out += site_lines(site)
    return out


def digest_line(digest: str, from_record: bool) -> Line:
    return line(f"digest {digest}" + ("  (from the state record)" if from_record else ""))


def interrupted_line(command: str) -> Line:
    text = (
        f"an interrupted k3patch {command} left a journal; the next apply or revert rolls it "
        "back first"
    )
    return line(text, 2, "error", 0, text.index(";"))


def status_lines(
    vllm: Mapping[str, Any],
    patches: Sequence[Mapping[str, Any]],
    results: Sequence[Mapping[str, Any]],
    digest: str,
    from_record: bool,
    interrupted: str | None = None,
    *,
    every_site: bool = False,
) -> list[Line]:
    out = [header(vllm), *patches_block(patches, results, every_site=every_site)]
    if interrupted:
        out.append(interrupted_line(interrupted))
    out.append(digest_line(digest, from_record))
    return out


def _was(before: Sequence[Mapping[str, Any]], patch_id: str) -> str:
    shapes = _unique(
        r.get("shape", "") for r in before if r["patch"] == patch_id and r["verdict"] == "pending"
    )
    return "; ".join(shapes)


def apply_lines(
    vllm: Mapping[str, Any],
    patches: Sequence[Mapping[str, Any]],
    results: Sequence[Mapping[str, Any]],
    *,
    before: Sequence[Mapping[str, Any]] = (),
    written: Sequence[str] = (),
    bytecode: Sequence[str] = (),
    recovered: Sequence[str] = (),
    refused: Sequence[str] = (),
    refused_text: str = "",
    all_or_nothing: bool = False,
    check: bool = False,
    every_site: bool = False,
    bugs: Mapping[str, str] | None = None,
) -> list[Line]:
    """The human report of `apply`: per patch its verdict now and, for a patch this run wrote,
    the shape it was in and the files it changed; then the files written, in full.
    `refused_text` says what was done about the drifted patches in `refused`; `bugs` names the
    patches left out because their rewrite failed its own checks, and how."""
    summaries: dict[str, str] = {}
    written_set = set(written)
    for patch in patches:
        files = _unique(
            r["file"]
            for r in before
            if r["patch"] == patch["id"] and r["verdict"] == "pending" and r["file"] in written_set
        )
        if files:
            was = _was(before, patch["id"])
            names = ", ".join(f.rsplit("/", 1)[-1] for f in files)
            summaries[patch["id"]] = (f"was {was}; " if was else "") + f"wrote {names}"
    out = [
        header(vllm),
        *patches_block(patches, results, every_site=every_site, summaries=summaries),
    ]
    out += [line(f"recovered: {step}") for step in recovered]
    if refused:
        out.append(line(f"refused: {refused_text}", 2, "error", 0, len("refused:")))
    out += [
        line(bug_text(patch_id, why), 2, "error", 0, len("refused:"))
        for patch_id, why in (bugs or {}).items()
    ]
    if bugs and all_or_nothing and not refused:
        out.append(line("nothing was written (--all-or-nothing)"))
    held = set(refused) | set(bugs or {})
    if check:
        pending = sorted({r["patch"] for r in results if r["verdict"] == "pending"} - held)
        if pending and not all_or_nothing:
            out.append(line("would apply: " + ", ".join(pending) + " (--check: nothing written)"))
        elif not held:
            out.append(line("nothing to do"))
    elif written:
        out.append(line("wrote:"))
        out += [line(f"  vllm/{rel}") for rel in written]
        out += [line(f"bytecode: {step}") for step in bytecode]
    elif not held:
        out.append(line("nothing to do"))
    return out


def bug_text(patch_id: str, why: str) -> str:
    """The line naming a patch an apply left out because its rewrite failed its own checks."""
    return (
        f"refused: {patch_id} (a k3patch bug: its rewrite failed its own checks; nothing of it "
        f"was written, report it): {why}"
    )


def list_lines(patches: Sequence[Mapping[str, Any]]) -> list[Line]:
    """`list`: per patch its id and what it fixes, the files it reads and what it does not cover."""
    id_width = max([len(p["id"]) for p in patches] or [0])
    out: list[Line] = []
    for p in patches:
        out.append(line(f"{p['id'].ljust(id_width)}  {p['title']}", id_width + 2))
        out.append(line("  files (under vllm/): " + ", ".join(p["files"]), 4))
        if p.get("caveat"):
            out.append(line(f"  not covered: {p['caveat']}", 4))
    return out
