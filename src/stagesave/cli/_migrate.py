"""``stagesave migrate ROOT``: format-1 checkpoints rewritten in place as format-2 checkpoints.

A format-1 checkpoint is a file plus a sidecar manifest ``<name>.<id>.stagesave.json`` (or a
folder plus its ``checkpoint.stagesave.json``). Migrating one:

1. reads every byte into page-aligned memory once and **verifies** it against the sidecar
   (size, serialization id, every chunk) through those very bytes: a checkpoint that does not
   verify is reported and left alone;
2. re-plans it without unpickling anything: a torch file's own zip is parsed
   (``_zipfmt.parse_torch_zip``) and its bytes become the file image as they are (storages at
   their record offsets, every record given its real CRC-32); in a folder, safetensors files
   are laid out again with room for their proof (same tensors, same metadata) and any other
   file is kept byte for byte as a raw file the folder's proof lists;
3. commits it with the core's commit (``_commit.commit_file`` / ``commit_folder``): written
   under a temporary name, made durable, sealed with its proof, then renamed over the old one
   (a folder: swapped with it) in one atomic step. The sidecars go afterwards. A crash leaves
   the old checkpoint or the new one, never neither.

The metadata, the tensor index and the telemetry of the original save are carried over (the
telemetry gains ``migrated``: the original creation time and sidecar). Order: a migrated
checkpoint keeps its original creation time and takes sequence number 0, below every checkpoint
format 2 ever saved (those start at 1), so format-1 checkpoints, which predate them, stay older
than any of them, in their original order among themselves, and migrating in any order or
with format-2 checkpoints already there never makes ``latest()`` return an older one. Sharded
(DCP) folders are reported ("re-save to migrate") and left alone; so are files
``stagesave adopt`` certified (stagesave must not modify them) unless ``--include-adopted``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.table import Table

from ..formats import Raw, Safetensors, plan_file
from ..ondisk.checksum import DIGEST_HEX_LEN, crc32
from ..ondisk.manifest import FileEntry, Manifest, StorageRecord
from ..ondisk.names import ALIGNMENT, DEFAULT_CHUNK_BYTES, DIR_MANIFEST, PROOF_KEY
from ..ondisk.torchzip import TorchZip, ZipFormatError, parse_torch_zip
from ..restore.discovery import CheckpointInfo, forget, resolve, resolve_dir, resolve_reader, scan
from ..restore.proof import chunk_problems
from ..saving.buffers import HostBuffer
from ..saving.commit import choose_carrier, commit_file, commit_folder
from ..saving.plan import FileImage, StorageSlot, TensorEntry
from ..saving.stage import stage_image
from ..saving.write import FileToWrite, WriteStats, proof_room
from ..stores.base import Store
from ._bytes import Loaded, MemReader, load_bytes
from ._common import CliError, Env, literal
from ._found import sidecars_of
from ._verify import THREADS, verify_checkpoint

__all__ = ["Result", "add_parser", "migrate", "run", "torch_image"]

#: Largest tensor-index entry count carried over (the core's own cap on what it indexes).
_MAX_INDEX = 200_000


class NotMigratable(Exception):
    """This checkpoint cannot be migrated, for the reason given (it is left as it is)."""

    def __init__(self, message: str, action: str = "failed") -> None:
        super().__init__(message)
        self.action = action


@dataclass
class Result:
    """What migrate did (or would do) with one checkpoint."""

    path: str
    folder: bool
    action: str  # migrated | would migrate | skipped | refused | failed
    detail: str = ""
    seq: int | None = None
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "folder": self.folder, "action": self.action, "detail": self.detail,
                "seq": self.seq, "problems": self.problems}


def _round_up(n: int) -> int:
    return max(ALIGNMENT, (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT)


# ---------------------------------------------------------------------------- torch files
def _index(tensors: Any) -> list[TensorEntry]:
    """The format-1 tensor index as the core's entries (malformed entries left out; fields an
    adopted file's index does not know stay empty rather than guessed)."""
    out: list[TensorEntry] = []
    for t in tensors if isinstance(tensors, list) else []:
        if len(out) >= _MAX_INDEX or not isinstance(t, dict):
            continue
        name, dtype, shape = t.get("name"), t.get("dtype"), t.get("shape")
        stride, offset, storage = t.get("stride", []), t.get("storage_offset"), t.get("storage")
        if not (isinstance(name, str) and isinstance(dtype, str) and isinstance(shape, list)
                and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
                and isinstance(stride, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in stride)):
            continue
        out.append(TensorEntry(
            name=name, storage_key=storage if isinstance(storage, str) else None,  # type: ignore[arg-type]
            dtype=dtype, shape=tuple(shape), stride=tuple(stride),
            storage_offset=offset if isinstance(offset, int) and not isinstance(offset, bool) else None,  # type: ignore[arg-type]
        ))
    return out


def torch_image(buf: HostBuffer, size: int, entry: FileEntry, tensors: Any, where: str) -> FileImage:
    """The file image of a torch file whose ``size`` bytes are in ``buf``: its own zip, its
    storages where they are, every record's real CRC-32 (fixed in ``buf`` where it was wrong:
    format-1 files carried zeros for storages and a stale one for the serialization id).

    Raises:
        NotMigratable: not a zip torch file, or its manifest's storages do not match its zip.
    """
    view = buf.view

    def read(off: int, n: int) -> bytes:
        return bytes(view[off : min(size, off + n)]) if 0 <= off < size else b""

    try:
        zip_ = parse_torch_zip(read, size)
    except ZipFormatError as exc:
        raise NotMigratable(
            f"{where} is not a zip torch file ({exc}; a legacy torch.save file?): it cannot carry a proof "
            "inside; it keeps its sidecar", "skipped") from exc
    by_name = {r.name: r for r in zip_.records}
    data = f"{zip_.prefix}/data/"
    if entry.storages:
        storages = list(entry.storages)
    else:  # an adopted file's manifest names no storages: the zip's own records
        storages = [StorageRecord(r.name[len(data):], r.data_offset, r.size) for r in zip_.records
                    if r.name.startswith(data) and "/" not in r.name[len(data):]]
    slots, slot_names = [], set()
    for st in storages:
        r = by_name.get(data + st.key)
        if r is None or r.data_offset != st.offset or r.size != st.nbytes:
            raise NotMigratable(f"{where}: storage {st.key} of its manifest is not a record of its zip")
        slots.append(StorageSlot(st.key, st.offset, st.nbytes, buf.tensor[st.offset : st.offset + st.nbytes]))
        slot_names.add(r.name)
    slots.sort(key=lambda s: s.offset)
    crcs = {}
    for r in zip_.records:
        if r.name in slot_names and r.descriptor_crc_at >= 0:
            continue  # filled in by the writer from the CRCs it computes anyway
        crc = crc32(view[r.data_offset : r.data_offset + r.size])
        crcs[r.name] = crc
        at = r.descriptor_crc_at if r.descriptor_crc_at >= 0 else r.header_offset + 14
        view[at : at + 4] = struct.pack("<I", crc)
    zip_ = TorchZip(zip_.prefix, zip_.records, zip_.cd_start, zip_.with_crcs(crcs), zip_.zip64)
    sid, id_offset = "", 0
    id_record = by_name.get(f"{zip_.prefix}/.data/serialization_id")
    if id_record is not None:
        text = read(id_record.data_offset, id_record.size)
        if text.isalnum() and 0 < len(text) <= 64:
            sid, id_offset = text.decode(), id_record.data_offset
    return FileImage(
        size=size, pieces=[], slots=slots, serialization_id=sid, id_offset=id_offset, tensors=_index(tensors),
        kind="torch", zip=zip_, crc_fields=[by_name[data + s.key].descriptor_crc_at for s in slots],
    )


# ---------------------------------------------------------------------------- helpers
def _settings(entry: FileEntry) -> tuple[str, int]:
    """The checksum algorithm and chunk size of the new proof: the old manifest's (chunks must be
    whole pages for the writer)."""
    cb = entry.chunk_bytes if entry.chunk_bytes % ALIGNMENT == 0 and entry.chunk_bytes <= 1 << 32 else DEFAULT_CHUNK_BYTES
    return entry.algorithm, cb


def _telemetry(m: Manifest, source: str) -> dict[str, Any]:
    old = m.telemetry if isinstance(m.telemetry, dict) else {}
    return {**old, "migrated": {"from_format": 1, "created_ns": m.created_ns, "from": source,
                                "migrated_at": time.time()}}


def _adopted(m: Manifest) -> bool:
    return isinstance(m.metadata, dict) and m.metadata.get("adopted_by") == "stagesave adopt"


@contextlib.contextmanager
def _read_verified(
    env: Env, store: Store, name: str, pool: cf.Executor, entry: FileEntry | None,
) -> Iterator[tuple[Loaded, int, CheckpointInfo | None]]:
    """Every byte of ``name`` in a page-aligned buffer, verified: against ``entry`` (a file of a
    folder), or against the file's own format-1 sidecar (``entry`` ``None``), read through the
    same bytes. Yields the bytes (``.buffer``: released at the end unless detached), the size,
    and (own sidecar) the file's info."""
    with store.open(name) as reader, env.progress(f"reading {name}", reader.size) as advance, \
            load_bytes(reader, pool=pool, advance=advance) as loaded:
        assert loaded.buffer is not None
        mem = MemReader(loaded.view, reader.where, name, reader.mtime)
        info = None
        if entry is None:
            info = resolve_reader(store, name, mem)
            if info.format == 2:
                raise NotMigratable(f"{reader.where} already carries its own proof (format 2)", "skipped")
            if info.status != "committed" or info.manifest is None:
                raise NotMigratable(f"{reader.where} does not verify: {'; '.join(info.problems) or info.status}")
            entry = info.manifest.files[0]
        elif entry.size != mem.size:
            raise NotMigratable(f"{reader.where} is {mem.size} bytes, its manifest says {entry.size}")
        problems = chunk_problems(mem, Manifest([entry], 0), pool)
        if problems:
            raise NotMigratable(f"{reader.where} does not verify: {problems[0]}")
        yield loaded, mem.size, info


# ---------------------------------------------------------------------------- one checkpoint
def _migrate_file(env: Env, store: Store, ci: CheckpointInfo, *, dry_run: bool, adopted_too: bool) -> Result:
    out = Result(ci.path, False, "would migrate" if dry_run else "migrated")
    with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-migrate") as pool, \
            _read_verified(env, store, ci.name, pool, None) as (loaded, size, info):
        assert info is not None and info.manifest is not None and loaded.buffer is not None
        buf = loaded.buffer
        m = info.manifest
        if _adopted(m) and not adopted_too:
            raise NotMigratable("certified by `stagesave adopt` (a file stagesave must not modify); "
                                "--include-adopted migrates it anyway", "skipped")
        entry = m.files[0]
        if entry.kind != "torch":
            raise NotMigratable(f"a {entry.kind} file: only torch files (and files of folders) are migrated; "
                                "it keeps its sidecar", "skipped")
        image = torch_image(buf, size, entry, m.tensors, info.path)
        if dry_run:
            out.detail = f"verified ({len(entry.chunks)} chunks, sidecar {info.manifest_name})"
            return out
        algorithm, chunk_bytes = _settings(entry)
        stats = WriteStats()
        tel = _telemetry(m, str(info.manifest_name))
        written = commit_file(
            store, FileToWrite(ci.name, image, buf.view), algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool,
            stats=stats, metadata=dict(m.metadata) if isinstance(m.metadata, dict) else {}, telemetry=lambda: tel,
            seq=0, created_ns=m.created_ns,
        )
        out.seq = written.manifest.seq if written.manifest is not None else None
    _check_after(env, store, ci, out)
    return out


def _room(files: Sequence[tuple[str, FileImage | None, Any]], algorithm: str, chunk_bytes: int,
          metadata: dict[str, Any]) -> dict[str, Any]:
    """The proof room of each safetensors file of a folder (mirrors ``Checkpointer._plan_folder``):
    the carrier's must hold the folder's list of files, the others only their own proof."""
    hex_len = DIGEST_HEX_LEN[algorithm]
    planned = {n: im for n, im, _ in files if im is not None}
    st = [n for n, im, _ in files if im is None]
    st_carrier = st[0] if st and not any(im.kind == "torch" for im in planned.values()) else None
    bound = {
        "token": "f" * 32, "carrier": "x" * 255,
        "members": [[n, 1 << 50, 0xFFFFFFFF] for n, _, _ in files],
        "listed": [{"name": n, "size": 1 << 50, "algorithm": algorithm, "chunk_bytes": chunk_bytes,
                    "chunks": ["f" * hex_len] * ((im.size + chunk_bytes - 1) // chunk_bytes + 1), "kind": "raw",
                    "serialization_id": None, "id_offset": None, "storages": []}
                   for n, im in planned.items() if im.kind == "raw"],
    }
    rooms = {}
    for n in st:
        carrier = n == st_carrier
        folder = bound if carrier else {"token": "f" * 32, "carrier": "x" * 255}
        meta = metadata if carrier else {}

        def room(size: int, storages: list[list[object]], folder: dict[str, Any] = folder,
                 meta: dict[str, Any] = meta) -> int:
            return proof_room(size, storages, algorithm=algorithm, chunk_bytes=chunk_bytes, metadata=meta,
                              folder=folder)

        rooms[n] = room
    return rooms


def _safetensors_content(buf: HostBuffer, size: int, where: str) -> Safetensors:
    from safetensors.torch import load

    data = bytes(buf.view[:size])
    try:
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8 : 8 + n])
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        tensors = load(data)
    except Exception as exc:
        raise NotMigratable(f"{where} cannot be read as a safetensors file: {exc}") from exc
    meta = {k: v for k, v in meta.items() if k != PROOF_KEY} if isinstance(meta, dict) else None
    return Safetensors({k: tensors[k] for k in sorted(tensors)}, meta or None)


def _staged(name: str, image: FileImage, buffers: list[HostBuffer]) -> FileToWrite:
    """``image`` copied into a page-aligned buffer of its own (kept in ``buffers``)."""
    buf = HostBuffer.allocate(_round_up(image.size), pinned=False)
    buffers.append(buf)
    stage_image(image, buf)
    return FileToWrite(name, image, buf.view, None, None, name)


def _migrate_folder(env: Env, store: Store, ci: CheckpointInfo, *, dry_run: bool) -> Result:
    out = Result(ci.path, True, "would migrate" if dry_run else "migrated")
    info = resolve_dir(store, ci.name)
    m = info.manifest
    if info.format != 1 or info.status != "committed" or m is None:
        raise NotMigratable(f"does not verify: {'; '.join(info.problems) or info.status}")
    names = {e.name for e in m.files}
    if ".metadata" in names or any(e.kind in ("dcp", "dcp-metadata") or e.name.endswith(".distcp") for e in m.files):
        raise NotMigratable("a sharded (torch.distributed.checkpoint) folder: re-save to migrate", "skipped")
    if store.local_path(ci.name) is None:
        raise NotMigratable("migrates folders on local disk only (an object store cannot replace a folder in "
                            "one step, and a crash would leave this only copy unproven)", "refused")
    extra = sorted({f.name.rpartition("/")[2] for f in store.list(ci.name)} - names - {DIR_MANIFEST})
    extra += [d + "/" for d in sorted(store.list_dirs(ci.name))]
    if extra:
        raise NotMigratable(f"holds files its manifest does not list ({', '.join(extra[:5])}): a format-2 folder holds "
                            "exactly its checkpoint's files; move them out first", "refused")
    entries = sorted(m.files, key=lambda e: e.name)
    algorithm, chunk_bytes = _settings(entries[0])
    metadata = dict(m.metadata) if isinstance(m.metadata, dict) else {}
    buffers: list[HostBuffer] = []
    try:
        with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-migrate") as pool:
            files: list[FileToWrite] = []
            pending_st: list[tuple[str, Safetensors]] = []
            for e in entries:
                full = f"{ci.name}/{e.name}"
                where = store.describe(full)
                with _read_verified(env, store, full, pool, e) as (loaded, size, _):
                    assert loaded.buffer is not None
                    if e.kind == "safetensors" or e.name.endswith(".safetensors"):
                        pending_st.append((e.name, _safetensors_content(loaded.buffer, size, where)))
                        continue
                    image: FileImage | None = None
                    if e.kind == "torch":
                        try:
                            image = torch_image(loaded.buffer, size, e, [], where)
                        except NotMigratable as exc:
                            if exc.action != "skipped":
                                raise  # a legacy torch file is kept byte for byte below
                    if image is not None:
                        buffers.append(loaded.detach())  # the buffer is the image
                        files.append(FileToWrite(e.name, image, loaded.buffer.view, None, None, e.name))
                        continue
                    raw = bytes(loaded.view[:size])
                files.append(_staged(e.name, plan_file(Raw(raw))[1], buffers))
            planned = [(f.entry_name or f.name, f.image, None) for f in files] + [(n, None, c) for n, c in pending_st]
            rooms = _room(planned, algorithm, chunk_bytes, metadata)
            for name, content in pending_st:
                files.append(_staged(name, plan_file(content, proof_room=rooms[name])[1], buffers))
            files.sort(key=lambda f: f.entry_name or f.name)
            try:
                carrier = choose_carrier(files).entry_name
            except ValueError as exc:
                raise NotMigratable(str(exc), "refused") from exc
            if dry_run:
                out.detail = f"verified {len(files)} files; {carrier} would carry the folder's proof"
                return out
            written = commit_folder(
                store, ci.name, files, algorithm=algorithm, chunk_bytes=chunk_bytes, pool=pool, stats=WriteStats(),
                metadata=metadata, telemetry=lambda: _telemetry(m, DIR_MANIFEST), seq=0, created_ns=m.created_ns,
            )
            carrier_manifest = written[-1].manifest  # the carrier is written last
            out.seq = carrier_manifest.seq if carrier_manifest is not None else None
    finally:
        for b in buffers:
            b.release_memory()
    _check_after(env, store, ci, out)
    return out


def _check_after(env: Env, store: Store, ci: CheckpointInfo, out: Result) -> None:
    """Read the migrated checkpoint back: it must verify as format 2, with no sidecar left."""
    forget(store, ci.name.rpartition("/")[0])
    now = resolve_dir(store, ci.name) if ci.is_dir else resolve(store, ci.name)
    verdict = verify_checkpoint(env, store, now)
    if now.format != 2 or verdict.status != "verified":
        out.action = "failed"
        out.problems = verdict.problems or [f"after migration it is {verdict.status} (format {now.format})"]
        return
    left = [] if ci.is_dir else sidecars_of(store, ci.name)
    out.detail = f"verified, seq {out.seq}" + (f"; left {', '.join(left)} (`stagesave gc` removes stale ones)"
                                               if left else "")


# ---------------------------------------------------------------------------- a root
def _migrated_created(c: CheckpointInfo) -> int | None:
    """The original creation time of a checkpoint this command migrated (from its telemetry)."""
    tel = c.manifest.telemetry if c.manifest is not None and isinstance(c.manifest.telemetry, dict) else {}
    mig = tel.get("migrated")
    if isinstance(mig, dict) and isinstance(mig.get("created_ns"), int):
        return int(mig["created_ns"])
    return None


def _format1(store: Store, name: str, is_dir: bool) -> list[CheckpointInfo]:
    """The format-1 checkpoints a path names: the checkpoint itself, or those directly in a root."""
    if name:
        ci = resolve_dir(store, name) if is_dir else resolve(store, name)
        return [ci] if ci.format == 1 else []
    return [c for c in scan(store, "", full=True) if c.format == 1]


def migrate(
    env: Env, store: Store, name: str, is_dir: bool, *, dry_run: bool = False, adopted_too: bool = False,
) -> list[Result]:
    """Migrate the format-1 checkpoints ``name`` names in ``store`` (``""``: every one directly
    in the root), oldest first. One that cannot be migrated is reported and left as it is."""
    todo = sorted(_format1(store, name, is_dir), key=lambda c: c.created)
    if not todo:
        return []
    results: list[Result] = []
    for ci in todo:
        if ci.status != "committed":
            results.append(Result(ci.path, ci.is_dir, "failed", "does not verify", problems=list(ci.problems)))
            continue
        try:
            if ci.is_dir:
                results.append(_migrate_folder(env, store, ci, dry_run=dry_run))
            else:
                results.append(_migrate_file(env, store, ci, dry_run=dry_run, adopted_too=adopted_too))
        except NotMigratable as exc:
            results.append(Result(ci.path, ci.is_dir, exc.action, str(exc)))
    return results


# ---------------------------------------------------------------------------- command
def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "migrate",
        help="rewrite format-1 checkpoints (sidecar manifests) in place as checkpoints that carry their own proof",
        description="Turn the format-1 checkpoints directly under ROOT (a file and its sidecar "
        "<name>.<id>.stagesave.json, or a folder with checkpoint.stagesave.json), or the one PATH "
        "names, into format-2 checkpoints that carry their own proof: each is verified first, "
        "re-planned without unpickling, committed over the old one atomically, then its sidecars "
        "are removed. Metadata, tensor index and telemetry are kept. Sharded (DCP) folders are "
        "left (re-save to migrate); so are files `stagesave adopt` certified, unless "
        "--include-adopted. --dry-run only verifies and lists.",
    )
    p.add_argument("root", metavar="ROOT|PATH")
    p.add_argument("--dry-run", "-n", action="store_true", help="verify and list what would be migrated, change nothing")
    p.add_argument("--include-adopted", action="store_true",
                   help="also rewrite files `stagesave adopt` certified (stagesave did not write them)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


_STYLE = {"migrated": "green", "would migrate": "green", "skipped": "yellow", "refused": "red", "failed": "bold red"}


def run(env: Env, args: argparse.Namespace) -> int:
    target = env.target(args.root)
    if target.is_dir and (not target.name or resolve_dir(target.store, target.name).format == 0):
        store, name, is_dir = env.root(args.root), "", True  # a root holding checkpoints
    else:
        store, name, is_dir = target.store, target.name, target.is_dir
    results = migrate(env, store, name, is_dir, dry_run=args.dry_run, adopted_too=args.include_adopted)
    bad = [r for r in results if r.action in ("failed", "refused")]
    if args.json:
        env.print_json({"root": store.describe(name) if name else store.url, "dry_run": args.dry_run,
                        "checkpoints": [r.to_dict() for r in results]})
    elif not results:
        env.say(f"no format-1 checkpoints at {store.describe(name) if name else store.url}; nothing to migrate")
    else:
        t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        for col in ("checkpoint", "result", "detail"):
            t.add_column(col, overflow="fold")
        for r in results:
            t.add_row(literal(r.path + ("/" if r.folder else "")), literal(r.action, _STYLE.get(r.action, "")),
                      literal(r.detail))
        env.out.print(t)
        for r in results:
            for p in r.problems:
                env.say(f"  {r.path}: {p}")
        n = sum(1 for r in results if r.action in ("migrated", "would migrate"))
        env.say(f"{n} of {len(results)} format-1 checkpoints {'would be ' if args.dry_run else ''}migrated")
    if bad:
        first = bad[0]
        reason = first.problems[0] if first.problems else first.detail
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CliError(f"{first.path} was not migrated: {reason}{more}")
    return 0
