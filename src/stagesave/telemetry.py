"""Per-save telemetry: where the time went, for the handle, a callback and JSON lines."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Protocol

__all__ = ["SaveTelemetry", "TelemetryCallback"]


@dataclass
class SaveTelemetry:
    """What one save cost. Times are seconds; ``*_at`` are Unix timestamps."""

    path: str
    bytes: int = 0
    tensor_bytes: int = 0
    started_at: float = 0.0
    plan_s: float = 0.0
    buffer_wait_s: float = 0.0
    stage_s: float = 0.0
    blocking_s: float = 0.0
    write_s: float = 0.0
    checksum_s: float = 0.0
    fsync_s: float = 0.0
    commit_s: float = 0.0
    time_to_commit_s: float = 0.0
    throughput_bytes_per_s: float = 0.0
    direct_io: bool | None = None
    committed_at: float | None = None
    error: str | None = None
    tier: str | None = None
    #: Where the save was staged: ``"host"``, or the device with ``device_staging`` (``"cuda:0"``).
    staged_on: str = "host"
    #: With device staging: whether kvikio (GPUDirect Storage) wrote the file.
    gpudirect: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), allow_nan=False)


class TelemetryCallback(Protocol):
    """Called on the writer thread once per save, committed or failed. Keep it cheap."""

    def __call__(self, telemetry: SaveTelemetry, /) -> None: ...
