"""`Finding`: what every rule produces, and its two outward shapes.

A finding answers "what is wrong, with which thread or device, how do we know, what to do":
a severity, a kind (the rule's name), a subject, the evidence and the advice in prose, and when
it was judged. The kernel rules also carry their numbers in `data`, for the report's `--json`;
the thread and clock rules put theirs in the prose only.

Two shapes outside the analyses, both kept as they always were:
- the `findings` table (`kdash.schema`), which the recorder keeps and captures store: one row
  per finding, without `data` (`to_row`, `from_row`, `findings_frame`, `findings_of`);
- the report's JSON object (`to_dict`): the row's fields and `data`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from kdash import schema

# Most severe first. `critical`: the thing cannot get better on its own or costs a lot;
# `warning`: a measured loss; `info`: a risk not yet seen costing anything.
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}

# The columns of the `findings` table, in its order.
ROW_FIELDS = ("t_ns", "severity", "kind", "subject", "evidence", "advice")


@dataclass(frozen=True)
class Finding:
    """One finding of one rule."""

    t_ns: int  # when it was judged: the last sample of its longest stretch, or its example
    severity: str  # a key of SEVERITY_ORDER (a stored row may hold another string)
    kind: str  # the rule: `off-local-cpu`, `gpu-idle-gaps`, ...
    subject: str  # the thread(s) or device it is about, as the user can find them
    evidence: str
    advice: str
    # the rule's numbers, for the report's `--json` (the kernel rules); not stored in captures
    data: Mapping[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        """Its place in SEVERITY_ORDER (an unknown severity after every known one)."""
        return SEVERITY_ORDER.get(self.severity, 9)

    def to_row(self) -> dict[str, object]:
        """A row of the `findings` table."""
        return {k: getattr(self, k) for k in ROW_FIELDS}

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Finding:
        """A finding back from a `findings` row (a capture's, the recorder's); no `data`."""
        return cls(
            t_ns=int(row["t_ns"]),
            **{k: str(row.get(k, "")) for k in ROW_FIELDS if k != "t_ns"},
        )

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON object: the row's fields, then `data`."""
        return {**self.to_row(), "data": dict(self.data)}


def findings_frame(found: Iterable[Finding]) -> pd.DataFrame:
    """Findings as the `findings` table (in the order given)."""
    rows = [f.to_row() for f in found]
    if not rows:
        return schema.to_frame("findings", schema.empty("findings"))
    return schema.to_frame("findings", schema.make_batch("findings", rows=rows))


def findings_of(table: pd.DataFrame | Mapping[str, Any] | None) -> list[Finding]:
    """The findings of a `findings` table: a DataFrame or a store batch (columns -> arrays)."""
    if table is None:
        return []
    if isinstance(table, pd.DataFrame):
        return [Finding.from_row(r) for r in table.to_dict("records")]
    n = len(table["t_ns"])
    return [Finding.from_row({c: table[c][i] for c in ROW_FIELDS}) for i in range(n)]
