"""The vocabulary of a classification, at the bottom of the house: what k3patch knows about a
site (`Verdict`), which verdicts are good, how a patch's sites sum to one verdict, and one site's
result as it is reported and recorded. The patches, the engine, the state record and the no-op
path all speak it; it imports nothing of k3patch.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


class Verdict(str, enum.Enum):
    """What k3patch knows about one site. Every command speaks this vocabulary."""

    PENDING = "pending"
    APPLIED = "applied"
    SATISFIED = "satisfied"
    NOT_APPLICABLE = "not applicable"
    DRIFTED = "drifted"

    @property
    def is_good(self) -> bool:
        """True for a site that is in a known good state (nothing left to do)."""
        return self.value in GOOD


# A site in one of these needs nothing more.
GOOD = frozenset({"applied", "satisfied", "not applicable"})
# The order in which site verdicts win when summarised into one verdict per patch: any drift
# makes the patch drifted, otherwise any pending site makes it pending, and so on.
SUMMARY_ORDER = ("drifted", "pending", "applied", "satisfied", "not applicable")


def summary(verdicts: Iterable[str]) -> str:
    """One verdict (its value) for a patch from the verdict values of its sites."""
    seen = set(verdicts)
    return next((verdict for verdict in SUMMARY_ORDER if verdict in seen), "not applicable")


def summarise(verdicts: Iterable[Verdict]) -> Verdict:
    """One verdict for a patch from the verdicts of its sites."""
    return Verdict(summary(verdict.value for verdict in verdicts))


@dataclass(frozen=True)
class SiteResult:
    """The classification of one site in one file."""

    patch_id: str
    site: str
    file: str
    verdict: Verdict
    shape: str = ""
    detail: str = ""
    line: int | None = None
    found: str = ""
    expected: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "patch": self.patch_id,
            "site": self.site,
            "file": self.file,
            "verdict": self.verdict.value,
            "shape": self.shape,
            "detail": self.detail,
            "line": self.line,
            "found": self.found,
            "expected": list(self.expected),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SiteResult:
        return cls(
            patch_id=data["patch"],
            site=data["site"],
            file=data["file"],
            verdict=Verdict(data["verdict"]),
            shape=data.get("shape", ""),
            detail=data.get("detail", ""),
            line=data.get("line"),
            found=data.get("found", ""),
            expected=tuple(data.get("expected", ())),
        )
