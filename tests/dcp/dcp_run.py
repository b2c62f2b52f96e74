"""The result of one multi-process sharded-checkpoint scenario (shared by conftest and tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Run:
    """What one multi-process scenario left: each rank's report, exit code and output."""

    out: Path
    ranks: list[dict[str, Any] | None]
    exit_codes: list[Any]
    scenario: str

    def log(self) -> str:
        parts = []
        for r in range(len(self.ranks)):
            p = self.out / f"{self.scenario}-rank{r}.log"
            if p.exists():
                parts.append(f"--- rank {r}\n{p.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def ok(self) -> None:
        for r, rep in enumerate(self.ranks):
            assert rep is not None and rep.get("ok"), f"rank {r}: {rep}\n{self.log()}"
