"""``stagesave inspect PATH``: what a checkpoint holds and how it was written, from its manifest."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from .._discovery import CheckpointInfo
from .._store import Store
from ..errors import CheckpointError, CheckpointNotFoundError
from ._common import Env
from ._found import (
    folder_files,
    manifest_tensors,
    needs_unsafe_global,
    resolve_target,
    step_of,
    tensor_index,
)
from ._ls import fmt_time
from ._units import fmt_bytes, fmt_duration, fmt_rate
from ._verify import first_line

__all__ = ["add_parser", "describe", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a checkpoint's files, tensors, checksums, metadata and save telemetry",
        description="Summarize one checkpoint (file or folder): status, files with their checksums, "
        "tensors (name, dtype, shape, bytes), framework metadata and the telemetry of the save. "
        "Reads the manifest, and only the structure of files without one (no tensor data).",
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("--tensors", type=int, default=30, metavar="N", help="show at most N tensors (default 30; 0: all)")
    p.add_argument("--trusted", action="store_true",
                   help="parse files without manifest with the full unpickler (only for files you trust)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _files(store: Store, ci: CheckpointInfo) -> list[dict[str, Any]]:
    if ci.manifest is not None:
        return [
            {"name": e.name, "store_name": f"{ci.name}/{e.name}" if ci.is_dir else ci.name, "kind": e.kind,
             "size": e.size, "algorithm": e.algorithm, "chunk_bytes": e.chunk_bytes, "chunks": len(e.chunks),
             "serialization_id": e.serialization_id, "first_digest": e.chunks[0] if e.chunks else None}
            for e in ci.manifest.files
        ]
    infos = folder_files(store, ci.name) if ci.is_dir else [store.info(ci.name)]
    return [
        {"name": f.name.rpartition("/")[2], "store_name": f.name,
         "kind": "safetensors" if f.name.endswith(".safetensors") else "torch", "size": f.size,
         "algorithm": None, "chunk_bytes": None, "chunks": 0, "serialization_id": None, "first_digest": None}
        for f in infos
    ]


def describe(store: Store, ci: CheckpointInfo, *, trusted: bool = False) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain data."""
    files = _files(store, ci)
    tensors: list[dict[str, Any]] = []
    notes: list[str] = []
    if ci.manifest is not None and ci.manifest.tensors:
        tensors = manifest_tensors(ci.manifest)
    elif ci.status != "corrupt":
        for f in files:
            try:
                found = tensor_index(store, f["store_name"], f["kind"], f["size"], trusted=trusted)
            except Exception as exc:  # noqa: BLE001 - a damaged file must not stop the summary
                if needs_unsafe_global(exc):
                    notes.append(f"{f['name']}: tensors not listed: it needs classes off the safe "
                                 "allow-list (--trusted parses it with the full unpickler)")
                else:
                    cause = exc.__cause__ if isinstance(exc, CheckpointError) and exc.__cause__ else exc
                    notes.append(f"{f['name']}: cannot be parsed: {first_line(cause)}")
                continue
            if len(files) > 1:
                for t in found:
                    t["name"] = f"{f['name']}:{t['name']}"
            tensors += found
    return {
        "path": ci.path,
        "status": ci.status,
        "folder": ci.is_dir,
        "size": ci.size,
        "created": ci.created,
        "step": step_of(ci.name, ci.manifest),
        "manifest": ci.manifest_name,
        "problems": ci.problems,
        "files": files,
        "tensors": tensors,
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "metadata": ci.manifest.metadata if ci.manifest else {},
        "telemetry": ci.manifest.telemetry if ci.manifest else {},
        "notes": notes,
    }


def _telemetry_rows(tel: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, label in (
        ("blocking_s", "blocked training"), ("plan_s", "  planning"), ("buffer_wait_s", "  waiting for a buffer"),
        ("stage_s", "  staging copy"), ("write_s", "background write"), ("checksum_s", "  hashing"),
        ("fsync_s", "  fsync"), ("commit_s", "commit"), ("time_to_commit_s", "time to commit"),
    ):
        v = tel.get(key)
        # Zero means "not known when the manifest was written" (commit times come after it).
        if isinstance(v, (int, float)) and v > 0:
            rows.append((label, fmt_duration(float(v))))
    rate = tel.get("throughput_bytes_per_s")
    if isinstance(rate, (int, float)) and rate > 0:
        rows.append(("write throughput", fmt_rate(float(rate))))
    if tel.get("direct_io") is not None:
        rows.append(("O_DIRECT", "yes" if tel["direct_io"] else "no"))
    return rows


def run(env: Env, args: argparse.Namespace) -> int:
    target = env.target(args.path)
    try:
        ci = resolve_target(target.store, target.name, target.is_dir)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"no checkpoint at {target.where}: {exc}") from exc
    doc = describe(target.store, ci, trusted=args.trusted)
    if args.json:
        env.print_json(doc)
        return 0
    o = env.out
    o.print(f"[bold]{doc['path']}[/]" + ("/" if doc["folder"] else ""))
    head = [
        ("status", doc["status"]), ("size", fmt_bytes(doc["size"])), ("created", fmt_time(doc["created"])),
    ]
    if doc["step"] is not None:
        head.append(("step", str(doc["step"])))
    if doc["manifest"]:
        head.append(("manifest", doc["manifest"]))
    for k, v in head:
        o.print(f"  {k:<9} {v}", markup=False)
    for p in doc["problems"]:
        o.print(f"  problem   {p}", markup=False)

    ft = Table(title="files", title_justify="left", header_style="bold", box=None, pad_edge=False)
    for col in ("file", "kind", "size", "checksum", "chunks", "serialization id"):
        ft.add_column(col, justify="right" if col in ("size", "chunks") else "left", overflow="fold")
    for f in doc["files"]:
        checksum = f"{f['algorithm']} {f['first_digest'][:12]}..." if f["algorithm"] else "none (no manifest)"
        ft.add_row(f["name"], f["kind"], fmt_bytes(f["size"]), checksum, str(f["chunks"]), f["serialization_id"] or "-")
    o.print(ft)

    tensors = doc["tensors"]
    if tensors:
        limit = args.tensors if args.tensors > 0 else len(tensors)
        tt = Table(title=f"tensors ({len(tensors)}, {fmt_bytes(doc['tensor_bytes'])})", title_justify="left",
                   header_style="bold", box=None, pad_edge=False)
        for col in ("name", "dtype", "shape", "bytes"):
            tt.add_column(col, justify="right" if col == "bytes" else "left", overflow="fold")
        for t in tensors[:limit]:
            tt.add_row(t["name"], t["dtype"], "x".join(str(s) for s in t["shape"]) or "scalar", fmt_bytes(t["bytes"]))
        o.print(tt)
        if len(tensors) > limit:
            o.print(f"  ... and {len(tensors) - limit} more (--tensors 0 shows all)")
    if doc["metadata"]:
        o.print("[bold]metadata[/]")
        o.print(json.dumps(doc["metadata"], indent=2, default=str), markup=False)
    tel_rows = _telemetry_rows(doc["telemetry"])
    if tel_rows:
        o.print("[bold]save telemetry[/]")
        for k, v in tel_rows:
            o.print(f"  {k:<22} {v}", markup=False)
    for n in doc["notes"]:
        o.print(f"note: {n}", markup=False)
    return 0
