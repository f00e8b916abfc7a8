"""The vocabulary of a classification, at the bottom of the house (it imports nothing of
k3patch): a site's `Verdict`, which verdicts are good, how a patch's sites sum to one verdict,
and one site's result as it is reported and recorded."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple


class Verdict(str, enum.Enum):
    """What k3patch knows about one site. Every command speaks this vocabulary."""

    PENDING = "pending"
    APPLIED = "applied"
    SATISFIED = "satisfied"
    NOT_APPLICABLE = "not applicable"
    DRIFTED = "drifted"

    @property
    def is_good(self) -> bool:
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


class SiteResult(NamedTuple):
    """The classification of one site in one file. A NamedTuple, not a dataclass: the no-op
    path loads these from the record, and `dataclasses` (with the `inspect` it imports) is a
    sixth of that path's start-up. `result._replace(verdict=...)` makes a changed copy."""

    patch_id: str
    site: str
    file: str
    verdict: Verdict
    shape: str = ""
    detail: str = ""
    line: int | None = None
    found: str = ""
    expected: tuple[str, ...] = ()

    @classmethod
    def drift(
        cls,
        patch_id: str,
        site: str,
        file: str,
        why: str,
        line: int | None = None,
        found: str = "",
        expected: Iterable[str] = (),
        shape: str = "",
    ) -> SiteResult:
        """The one way a drift is reported: why, where, what was found there (its source) and
        what was expected (the known shapes, each with its verdict)."""
        return cls(patch_id, site, file, Verdict.DRIFTED, shape, why, line, found, tuple(expected))

    def to_json(self) -> dict[str, Any]:
        data = {"patch": self.patch_id, **self._asdict(), "verdict": self.verdict.value}
        del data["patch_id"]
        return {**data, "expected": list(self.expected)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SiteResult:
        optional = {key: data[key] for key in ("shape", "detail", "line", "found") if key in data}
        verdict = Verdict(data["verdict"])
        expected = tuple(data.get("expected", ()))
        return cls(
            data["patch"], data["site"], data["file"], verdict, expected=expected, **optional
        )
