"""``stagesave inspect PATH``: what a checkpoint holds and how it was written, from its proof.

A format-2 checkpoint carries its proof inside its file(s): the sequence number, the checksum
algorithm and chunks, the torch serialization id, the tensor index, the metadata and the save's
telemetry are all read from there (and checked: the proof's own CRC, its zip records). A
format-1 checkpoint's proof is its sidecar manifest; a plain file has none, and only its
structure is read (no tensor data, with the safe unpickler unless ``--trusted``).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from rich.table import Table

from ..errors import CheckpointNotFoundError, IntegrityError
from ..restore.discovery import CheckpointInfo
from ._common import Env, literal
from ._describe import describe
from ._found import folder_above, resolve_target
from ._ls import fmt_time
from ._units import fmt_bytes, fmt_duration, fmt_rate

__all__ = ["add_parser", "run"]

_FORMAT = {
    2: "2 (the proof is inside the file)",
    1: "1 (a sidecar manifest beside the data)",
    0: "none (no proof)",
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect",
        help="show a checkpoint's proof: sequence number, files, checksums, tensors, metadata, "
             "telemetry",
        description="Summarize one checkpoint (file or folder) from its proof, read from inside "
        "the file(s) (format 2) or from its sidecar manifest (format 1): status, sequence number, "
        "files with their checksums, tensors (name, dtype, shape, bytes), metadata and the "
        "telemetry of the save. Files without a proof are summarized from their structure (no "
        "tensor data).",
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument(
        "--tensors",
        type=int,
        default=30,
        metavar="N",
        help="show at most N tensors (default 30; 0: all)",
    )
    p.add_argument(
        "--trusted",
        action="store_true",
        help="parse files without a proof with the full unpickler (only for files you trust)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def _number(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        try:
            f = float(v)
        except OverflowError:
            return None
        return f if math.isfinite(f) and f > 0 else None
    return None


def _telemetry_rows(tel: dict[str, Any]) -> list[tuple[str, str]]:
    rows = []
    for key, label in (
        ("blocking_s", "blocked training"),
        ("plan_s", "  planning"),
        ("buffer_wait_s", "  waiting for a buffer"),
        ("stage_s", "  staging copy"),
        ("write_s", "background write"),
        ("checksum_s", "  hashing"),
        ("fsync_s", "  fsync"),
        ("commit_s", "commit"),
        ("time_to_commit_s", "time to commit"),
    ):
        v = _number(tel.get(key))
        # Missing or zero means "not known when the proof was written" (commit times come after it).
        if v is not None:
            rows.append((label, fmt_duration(v)))
    rate = _number(tel.get("throughput_bytes_per_s"))
    if rate is not None:
        rows.append(("write throughput", fmt_rate(rate)))
    if isinstance(tel.get("direct_io"), bool):
        rows.append(("O_DIRECT", "yes" if tel["direct_io"] else "no"))
    if isinstance(tel.get("staged_on"), str):
        rows.append(("staged on", tel["staged_on"]))
    migrated = tel.get("migrated")
    if isinstance(migrated, dict) and isinstance(migrated.get("from_format"), int):
        rows.append(("migrated", f"from format {migrated['from_format']} by `stagesave migrate`"))
    return rows


def _shape(shape: list[int]) -> str:
    return "x".join(str(s) for s in shape) or "scalar"


def run(env: Env, args: argparse.Namespace) -> int:
    target = env.target(args.path)
    try:
        ci = resolve_target(target.store, target.name, target.is_dir)
    except FileNotFoundError as exc:
        raise CheckpointNotFoundError(f"no checkpoint at {target.where}: {exc}") from exc
    doc = describe(target.store, ci, trusted=args.trusted, part_of=_part_of(env, ci))
    if args.json:
        env.print_json(doc)
    else:
        _print(env, doc, args.tensors)
    if doc["status"] == "corrupt":
        first = doc["problems"][0] if doc["problems"] else "its proof does not hold"
        raise IntegrityError(f"{doc['path']} is corrupt: {first}")
    return 0


def _part_of(env: Env, ci: CheckpointInfo) -> str | None:
    """For one file of a format-2 folder checkpoint: that folder's path, found by looking for
    its carrier above the file (its proof names the carrier, not the file's own path in the
    folder)."""
    m = ci.manifest
    if ci.is_dir or m is None or m.folder is None:
        return None
    return folder_above(env.root, ci.path, m.folder.token, m.folder.carrier)


def _print(env: Env, doc: dict[str, Any], max_tensors: int) -> None:
    o = env.out
    o.print(literal(doc["path"] + ("/" if doc["folder"] else ""), "bold"))
    head = [("status", doc["status"]), ("format", _FORMAT.get(doc["format"], str(doc["format"])))]
    if doc["seq"] is not None:
        head.append(("seq", str(doc["seq"])))
    head += [("size", fmt_bytes(doc["size"])), ("created", fmt_time(doc["created"]))]
    if doc["step"] is not None:
        head.append(("step", str(doc["step"])))
    if doc["manifest"]:
        head.append(("manifest", doc["manifest"]))
    if doc["carrier"] and not doc["folder"]:
        if doc["part_of"] is None:
            folder = f"a folder checkpoint (its carrier {doc['carrier']} was not found above it)"
        else:
            folder = f"the folder checkpoint {doc['part_of']}/"
        role = ("its carrier" if doc["files"] and doc["files"][0]["role"] == "carrier"
                else f"a member (carrier {doc['carrier']})")
        text = f"{folder}, as {role}; inspect the folder to check every file of it"
        head.append(("part of", text))
    elif doc["carrier"]:
        head.append(("carrier", f"{doc['carrier']} (its proof names every file of the folder)"))
    for k, v in head:
        env.say(f"  {k:<9} {v}")
    for p in doc["problems"]:
        env.say(f"  problem   {p}")

    ft = Table(title="files", title_justify="left", header_style="bold", box=None, pad_edge=False)
    for col in ("file", "kind", "size", "checksum", "chunks", "serialization id", "proof"):
        ft.add_column(
            col, justify="right" if col in ("size", "chunks") else "left", overflow="fold"
        )
    for f in doc["files"]:
        checksum = (
            f"{f['algorithm']} {f['first_digest'][:12]}..."
            if f["algorithm"] and f["first_digest"]
            else f["algorithm"] or "none (no proof)"
        )
        ft.add_row(
            literal(f["name"]),
            literal(f["kind"]),
            fmt_bytes(f["size"]),
            literal(checksum),
            str(f["chunks"]),
            literal(f["serialization_id"] or "-"),
            literal(f["proof"] or "-"),
        )
    o.print(ft)

    tensors = doc["tensors"]
    if tensors:
        limit = max_tensors if max_tensors > 0 else len(tensors)
        tt = Table(
            title=f"tensors ({len(tensors)}, {fmt_bytes(doc['tensor_bytes'])})",
            title_justify="left",
            header_style="bold",
            box=None,
            pad_edge=False,
        )
        for col in ("name", "dtype", "shape", "bytes"):
            tt.add_column(col, justify="right" if col == "bytes" else "left", overflow="fold")
        for t in tensors[:limit]:
            nbytes = t["bytes"]
            tt.add_row(literal(str(t["name"])), literal(str(t["dtype"])), _shape(t["shape"]),
                       fmt_bytes(nbytes) if isinstance(nbytes, int) else "?")
        o.print(tt)
        if len(tensors) > limit:
            env.say(f"  ... and {len(tensors) - limit} more (--tensors 0 shows all)")
    if doc["metadata"]:
        o.print(literal("metadata", "bold"))
        o.print(json.dumps(doc["metadata"], indent=2, default=str), markup=False, highlight=False)
    tel_rows = _telemetry_rows(doc["telemetry"])
    if tel_rows:
        o.print(literal("save telemetry", "bold"))
        for k, v in tel_rows:
            env.say(f"  {k:<22} {v}")
    for n in doc["notes"]:
        env.say(f"note: {n}")
