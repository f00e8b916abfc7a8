"""The operators' real trees, built at test time: the vLLM 0.28.0 wheel plus the site edits of the
recipe's older scripts (MAD `scripts/vllm/kimik3_mi300x/wideep_disagg_2p2d/patchers/
apply_kimik3_*.py`), made in the order the recipe runs them.

Nothing of vLLM or of those scripts is committed as a file. Each edit is a `Hunk`: an anchor that
must occur exactly once in the real 0.28.0 file (or in the file as the earlier hunks left it), and
its replacement. Only the statements k3patch matches are reproduced verbatim from the script
named in the hunk; the rest of each replacement is written in our own words with the same
structure (the same names bound, the same control flow), which is all k3patch reads. A hunk whose
anchor is missing or ambiguous fails the build loudly: a builder that silently skips an edit
would test a tree nobody runs.

Steps register themselves from the modules of this package (one module per older script); a
tree is a list of step names. `build(name, dest)` makes tree `name` under `dest`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

BASE_VERSION = "0.28.0"


class BuilderError(AssertionError):
    """An anchor of an older script's hunk does not match the tree exactly once."""


@dataclass(frozen=True)
class Hunk:
    """One edit of one older script: `old` -> `new` in `file` (relative to the vllm package)."""

    script: str  # e.g. "apply_kimik3_moriio_mamba_blockids.py"
    hunk: str  # where in that script, e.g. "patch_engine, hunk 3 (_prepare_transfer_plan)"
    file: str
    old: str
    new: str


# step name -> the hunks it makes, in order; filled by the step modules below.
STEPS: dict[str, tuple[Hunk, ...]] = {}
# step name -> a function that edits the vllm dir itself (for edits that are not anchor -> text)
ACTIONS: dict[str, Callable[[Path], None]] = {}


def step(name: str, hunks: Sequence[Hunk]) -> None:
    if name in STEPS or name in ACTIONS:
        raise ValueError(f"step {name!r} registered twice")
    STEPS[name] = tuple(hunks)


def action(name: str, fn: Callable[[Path], None]) -> None:
    if name in STEPS or name in ACTIONS:
        raise ValueError(f"step {name!r} registered twice")
    ACTIONS[name] = fn


def apply_hunks(vllm_dir: Path, hunks: Sequence[Hunk]) -> None:
    """Make each hunk's edit; its anchor must occur exactly once (else BuilderError)."""
    for h in hunks:
        path = vllm_dir / h.file
        if not path.is_file():
            raise BuilderError(f"{h.script} / {h.hunk}: {h.file} is not in the tree")
        text = path.read_text(encoding="utf-8")
        count = text.count(h.old)
        if count != 1:
            raise BuilderError(
                f"{h.script} / {h.hunk}: anchor found {count} times in {h.file} (want exactly 1)"
            )
        path.write_text(text.replace(h.old, h.new, 1), encoding="utf-8")


def run_steps(vllm_dir: Path, steps: Sequence[str]) -> None:
    for name in steps:
        if name in STEPS:
            apply_hunks(vllm_dir, STEPS[name])
        elif name in ACTIONS:
            ACTIONS[name](vllm_dir)
        else:
            raise KeyError(f"unknown builder step {name!r}; known: {sorted({*STEPS, *ACTIONS})}")


# tree name -> (the steps, in the recipe's order; what the tree stands for). Filled below.
TREES: dict[str, tuple[tuple[str, ...], str]] = {}


def tree(name: str, steps: Sequence[str], about: str) -> None:
    if name in TREES:
        raise ValueError(f"tree {name!r} declared twice")
    TREES[name] = (tuple(steps), about)


def build(name: str, pristine_site: Path, dest: Path) -> Path:
    """Copy the pristine 0.28.0 site-packages dir `pristine_site` to `dest` and run tree `name`'s
    steps on it. Returns `dest` (a site-packages dir holding `vllm/`)."""
    steps, _about = TREES[name]
    shutil.copytree(pristine_site, dest, ignore=shutil.ignore_patterns(".complete"))
    run_steps(dest / "vllm", steps)
    return dest


# The step modules register on import; each names the older script it reproduces.
from . import trees as _trees  # noqa: E402,F401
