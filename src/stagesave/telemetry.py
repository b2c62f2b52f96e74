"""Per-save telemetry: where the time went, for the handle, a callback and JSON lines."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from .ondisk.names import TELEMETRY_FILE

__all__ = ["SaveTelemetry", "SinkOption", "TelemetryCallback", "TelemetrySink"]


@dataclass
class SaveTelemetry:
    """What one save cost. Times are seconds; ``*_at`` are Unix timestamps."""

    path: str
    bytes: int = 0
    tensor_bytes: int = 0
    started_at: float = 0.0
    plan_s: float = 0.0
    #: A save held to be planned behind the caller (``plan_behind``): its plan on the writer
    #: thread (``plan_s`` is then the caller's walk and copy; 0.0 for other saves).
    plan_behind_s: float = 0.0
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


class TelemetrySink:
    """Where a Checkpointer's finished saves report: a callback and/or JSON lines.

    ``jsonl``: ``True`` appends to :data:`TELEMETRY_FILE` beside each local checkpoint, a path
    appends there. A failing callback or file is reported on stderr, never fails a save.
    """

    def __init__(self, callback: TelemetryCallback | None, jsonl: bool | str) -> None:
        self.callback, self.jsonl = callback, jsonl

    def attach(self, store: Any) -> None:
        """Have ``store`` (a tiered store: its remote commits) report here too."""
        attach = getattr(store, "attach_telemetry", None)
        if attach is not None:
            attach(self.emit)

    def emit(self, tel: SaveTelemetry) -> None:
        if self.callback is not None:
            try:
                self.callback(tel)
            except Exception as exc:  # noqa: BLE001 - a broken callback must not fail saves
                print(f"stagesave: telemetry callback failed: {exc!r}", file=sys.stderr)
        if not self.jsonl:
            return
        target = self.jsonl
        if target is True:
            if not tel.path.startswith("/"):
                return
            target = os.path.join(os.path.dirname(tel.path), TELEMETRY_FILE)
        try:
            with open(str(target), "a", encoding="utf-8") as f:
                f.write(tel.to_json() + "\n")
        except OSError as exc:
            print(f"stagesave: cannot append telemetry to {target}: {exc}", file=sys.stderr)


class SinkOption:
    """An attribute of the owner (``telemetry_callback``, ``telemetry_jsonl``) that reads and
    sets the field of its ``telemetry_sink`` (so a change after construction takes effect)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name.removeprefix("telemetry_")

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.telemetry_sink, self.field)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj.telemetry_sink, self.field, value)
