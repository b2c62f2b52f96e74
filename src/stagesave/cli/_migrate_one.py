"""Migrating one format-1 checkpoint (a file or a folder): read every byte once into
page-aligned memory and verify it against its sidecar through those very bytes, re-plan it
(``_replan.py``), commit it over the old one with the core's commit, then read it back: it
must verify as format 2.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..formats import Raw, Safetensors, plan_file
from ..ondisk.manifest import FileEntry, Manifest
from ..ondisk.names import ALIGNMENT, DEFAULT_CHUNK_BYTES, DIR_MANIFEST
from ..restore.discovery import CheckpointInfo, forget, resolve, resolve_dir, resolve_reader
from ..restore.proof import chunk_problems
from ..saving.buffers import HostBuffer
from ..saving.commit import choose_carrier, commit_file, commit_folder
from ..saving.plan import FileImage
from ..saving.write import FileToWrite, WriteStats
from ..stores.base import Store
from ._bytes import Loaded, MemReader, load_bytes
from ._common import Env
from ._found import sidecars_of
from ._replan import NotMigratable, folder_rooms, safetensors_content, staged, torch_image
from ._verify import THREADS, verify_checkpoint

__all__ = ["Result", "migrate_file", "migrate_folder"]


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
        return {
            "path": self.path,
            "folder": self.folder,
            "action": self.action,
            "detail": self.detail,
            "seq": self.seq,
            "problems": self.problems,
        }



# ---------------------------------------------------------------------------- helpers
def _settings(entry: FileEntry) -> tuple[str, int]:
    """The checksum algorithm and chunk size of the new proof: the old manifest's (chunks must be
    whole pages for the writer)."""
    cb = (
        entry.chunk_bytes
        if entry.chunk_bytes % ALIGNMENT == 0 and entry.chunk_bytes <= 1 << 32
        else DEFAULT_CHUNK_BYTES
    )
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
                raise NotMigratable(
                    f"{reader.where} already carries its own proof (format 2)", "skipped"
                )
            if info.status != "committed" or info.manifest is None:
                raise NotMigratable(
                    f"{reader.where} does not verify: {'; '.join(info.problems) or info.status}"
                )
            entry = info.manifest.files[0]
        elif entry.size != mem.size:
            raise NotMigratable(
                f"{reader.where} is {mem.size} bytes, its manifest says {entry.size}"
            )
        problems = chunk_problems(mem, Manifest([entry], 0), pool)
        if problems:
            raise NotMigratable(f"{reader.where} does not verify: {problems[0]}")
        yield loaded, mem.size, info


# ---------------------------------------------------------------------------- one checkpoint
def migrate_file(
    env: Env, store: Store, ci: CheckpointInfo, *, dry_run: bool, adopted_too: bool
) -> Result:
    out = Result(ci.path, False, "would migrate" if dry_run else "migrated")
    with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-migrate") as pool, \
            _read_verified(env, store, ci.name, pool, None) as (loaded, size, info):
        assert info is not None and info.manifest is not None and loaded.buffer is not None
        buf = loaded.buffer
        m = info.manifest
        if _adopted(m) and not adopted_too:
            raise NotMigratable(
                "certified by `stagesave adopt` (a file stagesave must not modify); "
                "--include-adopted migrates it anyway",
                "skipped",
            )
        entry = m.files[0]
        if entry.kind != "torch":
            raise NotMigratable(
                f"a {entry.kind} file: only torch files (and files of folders) are migrated; "
                "it keeps its sidecar",
                "skipped",
            )
        image = torch_image(buf, size, entry, m.tensors, info.path)
        if dry_run:
            out.detail = f"verified ({len(entry.chunks)} chunks, sidecar {info.manifest_name})"
            return out
        algorithm, chunk_bytes = _settings(entry)
        stats = WriteStats()
        tel = _telemetry(m, str(info.manifest_name))
        written = commit_file(
            store,
            FileToWrite(ci.name, image, buf.view),
            algorithm=algorithm,
            chunk_bytes=chunk_bytes,
            pool=pool,
            stats=stats,
            metadata=dict(m.metadata) if isinstance(m.metadata, dict) else {},
            telemetry=lambda: tel,
            seq=0,
            created_ns=m.created_ns,
        )
        out.seq = written.manifest.seq if written.manifest is not None else None
    _check_after(env, store, ci, out)
    return out


def migrate_folder(env: Env, store: Store, ci: CheckpointInfo, *, dry_run: bool) -> Result:
    out = Result(ci.path, True, "would migrate" if dry_run else "migrated")
    info = resolve_dir(store, ci.name)
    m = info.manifest
    if info.format != 1 or info.status != "committed" or m is None:
        raise NotMigratable(f"does not verify: {'; '.join(info.problems) or info.status}")
    names = {e.name for e in m.files}
    if ".metadata" in names or any(
        e.kind in ("dcp", "dcp-metadata") or e.name.endswith(".distcp") for e in m.files
    ):
        raise NotMigratable(
            "a sharded (torch.distributed.checkpoint) folder: re-save to migrate", "skipped"
        )
    if store.local_path(ci.name) is None:
        raise NotMigratable(
            "migrates folders on local disk only (an object store cannot replace a folder in "
            "one step, and a crash would leave this only copy unproven)",
            "refused",
        )
    extra = sorted(
        {f.name.rpartition("/")[2] for f in store.list(ci.name)} - names - {DIR_MANIFEST}
    )
    extra += [d + "/" for d in sorted(store.list_dirs(ci.name))]
    if extra:
        raise NotMigratable(
            f"holds files its manifest does not list ({', '.join(extra[:5])}): to keep them, "
            "the folder would be rewritten in place, and a crash then would leave this only "
            "copy unproven; move them out first",
            "refused",
        )
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
                        pending_st.append((e.name, safetensors_content(loaded.buffer, size, where)))
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
                        files.append(
                            FileToWrite(e.name, image, loaded.buffer.view, None, None, e.name)
                        )
                        continue
                    raw = bytes(loaded.view[:size])
                files.append(staged(e.name, plan_file(Raw(raw))[1], buffers))
            planned = [(f.entry_name or f.name, f.image, None) for f in files] + [
                (n, None, c) for n, c in pending_st
            ]
            rooms = folder_rooms(planned, algorithm, chunk_bytes, metadata)
            for name, content in pending_st:
                files.append(staged(name, plan_file(content, proof_room=rooms[name])[1], buffers))
            files.sort(key=lambda f: f.entry_name or f.name)
            try:
                carrier = choose_carrier(files).entry_name
            except ValueError as exc:
                raise NotMigratable(str(exc), "refused") from exc
            if dry_run:
                out.detail = (
                    f"verified {len(files)} files; {carrier} would carry the folder's proof"
                )
                return out
            written = commit_folder(
                store,
                ci.name,
                files,
                algorithm=algorithm,
                chunk_bytes=chunk_bytes,
                pool=pool,
                stats=WriteStats(),
                metadata=metadata,
                telemetry=lambda: _telemetry(m, DIR_MANIFEST),
                seq=0,
                created_ns=m.created_ns,
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
        out.problems = verdict.problems or [
            f"after migration it is {verdict.status} (format {now.format})"
        ]
        return
    left = [] if ci.is_dir else sidecars_of(store, ci.name)
    out.detail = f"verified, seq {out.seq}" + (
        f"; left {', '.join(left)} (`stagesave gc` removes stale ones)" if left else ""
    )
