"""``stagesave export`` and ``stagesave adopt``: into and out of plain torch files.

``export`` turns a checkpoint of any layout it knows into ONE plain ``torch.save`` file. Layouts
are small classes in ``LAYOUTS`` (tried in order; the first whose ``matches`` says yes reads the
checkpoint): a single torch file is copied byte for byte (verified against its manifest on the
way, never unpickled), a single safetensors file becomes a dict of tensors, an Accelerate
``save_state`` folder becomes ``{"model": ..., "optimizer": ..., "scheduler": ..., ...}``, and a
sharded folder written by ``stagesave.dcp`` is gathered through its verifying reader (safe
metadata, local or remote), and any other local ``torch.distributed.checkpoint`` folder goes
through torch's own ``dcp_to_torch_save`` (its metadata is a pickle: ``--trusted`` only).

``adopt`` writes a manifest (chunk checksums, torch serialization id, tensor index) beside an
existing plain checkpoint, so that ``verify``, ``latest(verify=True)`` and verified loads can
prove it from then on; the data file itself is not touched.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import io
import json
import os
import tempfile
import time
from typing import IO, Any, ClassVar

import torch

from .._checksum import DEFAULT_ALGORITHM, check_algorithm, digest
from .._commit import manifest_path_for, sibling_manifests
from .._discovery import CheckpointInfo, resolve
from .._manifest import FileEntry, Manifest
from .._names import ALIGNMENT, DEFAULT_CHUNK_BYTES, MAX_FILE_BYTES
from .._store import Store
from .._targets import is_url
from ..errors import IntegrityError, UnsafeCheckpointError
from ..safety import safe_torch_load
from ._common import CliError, Env, Target
from ._found import folder_files, needs_unsafe_global, resolve_target, tensor_index
from ._units import fmt_bytes
from ._verify import THREADS, entries_of, first_line

__all__ = ["LAYOUTS", "add_parser", "adopt_file", "export"]


# --------------------------------------------------------------------------- reading, verified
def read_verified(env: Env, store: Store, name: str, entry: FileEntry | None, size: int) -> bytes:
    """A whole file, each chunk checked against ``entry`` when there is one.

    Raises:
        IntegrityError: a chunk does not match the manifest, or the file is truncated.
    """
    out = bytearray(entry.size if entry is not None else size)
    view = memoryview(out)
    step = entry.chunk_bytes if entry is not None else DEFAULT_CHUNK_BYTES
    where = store.describe(name)
    with env.progress(f"reading {name}", len(out)) as advance:

        def one(i: int) -> None:
            lo = i * step
            hi = min(len(out), lo + step)
            n = store.read_into(name, lo, view[lo:hi])
            advance(n)
            if n != hi - lo:
                raise IntegrityError(f"{where} is truncated at byte {lo + n}")
            if entry is not None and digest(entry.algorithm, view[lo:hi]) != entry.chunks[i]:
                raise IntegrityError(
                    f"{where} is corrupt: checksum mismatch in bytes [{lo}, {hi}); nothing was exported"
                )

        with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-read") as pool:
            list(pool.map(one, range((len(out) + step - 1) // step)))
    return bytes(out)


def _entry_for(ci: CheckpointInfo, name: str) -> FileEntry | None:
    if ci.manifest is None:
        return None
    for store_name, entry in entries_of(ci):
        if store_name == name:
            return entry
    return None


def _load_torch_bytes(data: bytes, where: str, trusted: bool) -> Any:
    return safe_torch_load(io.BytesIO(data), map_location="cpu", trusted=trusted, where=where)


def _load_safetensors_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    loaded = load(data)
    return {k: loaded[k] for k in sorted(loaded)}  # deterministic order, whatever the file's


# --------------------------------------------------------------------------- layouts
class Layout:
    """A checkpoint layout ``export`` can read. Subclasses set ``name`` and implement both."""

    name: ClassVar[str] = ""

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        raise TypeError(f"{type(self).__name__} does not implement matches()")

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: IO[bytes], trusted: bool) -> None:
        """Write the checkpoint as one torch file into ``out``."""
        raise TypeError(f"{type(self).__name__} does not implement export()")


class TorchFile(Layout):
    """A single torch file (stagesave's or plain): copied byte for byte, verified on the way."""

    name = "torch file"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        if target.is_dir or target.name.endswith(".safetensors"):
            return False
        head = target.store.read_range(target.name, 0, 4)
        return head == b"PK\x03\x04" or head[:1] == b"\x80"  # a zip, or a legacy pickle

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: IO[bytes], trusted: bool) -> None:
        assert ci is not None
        store, name = target.store, target.name
        entry = _entry_for(ci, name)
        size = entry.size if entry is not None else ci.size
        step = entry.chunk_bytes if entry is not None else DEFAULT_CHUNK_BYTES
        where = store.describe(name)
        n_chunks = (size + step - 1) // step

        def read(i: int) -> bytes:
            lo = i * step
            data = store.read_range(name, lo, min(step, size - lo))
            if len(data) != min(step, size - lo):
                raise IntegrityError(f"{where} is truncated at byte {lo + len(data)}")
            if entry is not None and digest(entry.algorithm, data) != entry.chunks[i]:
                raise IntegrityError(f"{where} is corrupt: checksum mismatch in chunk {i}; nothing was exported")
            return data

        with env.progress(f"copying {name}", size) as advance, cf.ThreadPoolExecutor(THREADS) as pool:
            for batch in range(0, n_chunks, THREADS):  # bounded read-ahead, written in order
                for data in pool.map(read, range(batch, min(n_chunks, batch + THREADS))):
                    out.write(data)
                    advance(len(data))


class SafetensorsFile(Layout):
    """A single safetensors file: becomes a dict of tensors."""

    name = "safetensors file"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        return not target.is_dir and target.name.endswith(".safetensors")

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: IO[bytes], trusted: bool) -> None:
        assert ci is not None
        data = read_verified(env, target.store, target.name, _entry_for(ci, target.name), ci.size)
        torch.save(_load_safetensors_bytes(data), out)


class AccelerateFolder(Layout):
    """An Accelerate ``save_state`` folder (with or without a stagesave manifest).

    Each file becomes one key, named after it: ``model.safetensors`` / ``pytorch_model.bin`` ->
    ``model``, ``model_1.safetensors`` -> ``model_1``, ``optimizer.bin`` -> ``optimizer``,
    ``random_states_0.pkl`` -> ``random_states_0``; a sharded model (``*.index.json``) is
    merged back into one state dict.
    """

    name = "Accelerate folder"
    _INDEX = ".safetensors.index.json"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        if not target.is_dir:
            return False
        return any(f.name.endswith((".safetensors", ".bin", ".pkl", ".pt")) for f in target.store.list(target.name))

    @staticmethod
    def key_for(leaf: str) -> str:
        stem = leaf.rsplit(".", 1)[0]
        if stem.startswith("pytorch_model"):
            stem = "model" + stem[len("pytorch_model") :]
        return stem

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: IO[bytes], trusted: bool) -> None:
        assert ci is not None
        store = target.store
        files = {f.name.rpartition("/")[2]: f for f in folder_files(store, target.name)}
        shard_of: dict[str, str] = {}
        for f in store.list(target.name):
            leaf = f.name.rpartition("/")[2]
            if leaf.endswith(self._INDEX):
                index = json.loads(store.read_range(f.name, 0, f.size))
                model = self.key_for(leaf[: -len(self._INDEX)] + ".safetensors")
                for shard in set(index.get("weight_map", {}).values()):
                    shard_of[shard] = model
        state: dict[str, Any] = {}
        for leaf in sorted(files):
            f = files[leaf]
            data = read_verified(env, store, f.name, _entry_for(ci, f.name), f.size)
            where = store.describe(f.name)
            if leaf.endswith(".safetensors"):
                tensors = _load_safetensors_bytes(data)
                if leaf in shard_of:
                    state.setdefault(shard_of[leaf], {}).update(tensors)
                else:
                    state[self.key_for(leaf)] = tensors
            else:
                state[self.key_for(leaf)] = _load_torch_bytes(data, where, trusted)
        torch.save(state, out)


class StagedDcpFolder(Layout):
    """A sharded checkpoint written by ``stagesave.dcp``: every rank file verified against the
    manifest, metadata read with the safe allow-list (no ``--trusted`` needed), local or remote."""

    name = "stagesave sharded (torch.distributed.checkpoint) folder"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        if not target.is_dir or ci is None or ci.manifest is None:
            return False
        return any(f.name == ".metadata" for f in ci.manifest.files)

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: IO[bytes], trusted: bool) -> None:
        from stagesave.dcp import to_state_dict

        state = to_state_dict(target.name, store=target.store, trusted=trusted)
        torch.save(state, out)


class DcpFolder(Layout):
    """A local ``torch.distributed.checkpoint`` folder (``.metadata`` + ``*.distcp``), through
    torch's own ``dcp_to_torch_save``. Its metadata is a pickle, so ``--trusted`` is required."""

    name = "torch.distributed.checkpoint folder"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        if not target.is_dir:
            return False
        return any(f.name.rpartition("/")[2] == ".metadata" for f in target.store.list(target.name))

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: IO[bytes], trusted: bool) -> None:
        local = target.store.local_path(target.name)
        if local is None:
            raise CliError(f"{target.where}: export reads torch.distributed.checkpoint folders from local disk only; copy it locally first")
        if not trusted:
            raise UnsafeCheckpointError(
                f"refusing to read {target.where}: torch.distributed.checkpoint metadata is a plain "
                "pickle and unpickling it could run code; pass --trusted if you trust its source"
            )
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory(prefix="stagesave-export-") as tmp:
            path = os.path.join(tmp, "state.pt")
            dcp_to_torch_save(local, path)
            with open(path, "rb") as f:
                while chunk := f.read(DEFAULT_CHUNK_BYTES):
                    out.write(chunk)


#: Tried in order; the first layout whose ``matches`` is true exports the checkpoint.
LAYOUTS: list[Layout] = [StagedDcpFolder(), DcpFolder(), TorchFile(), SafetensorsFile(), AccelerateFolder()]


# --------------------------------------------------------------------------- output
class _Output:
    """The export target: invisible until everything is written (temp + fsync + rename locally,
    a single upload of a finished local spool file for URLs)."""

    def __init__(self, env: Env, path: str, force: bool) -> None:
        self.env, self.path, self.force = env, path, force

    def __enter__(self) -> IO[bytes]:
        if is_url(self.path):
            store, name = self.env.resolver.split(self.path)
            self.remote: tuple[Store, str] | None = (store, name)
            if not self.force:
                try:
                    store.info(name)
                    raise CliError(f"{self.path} exists; pass --force to replace it")
                except FileNotFoundError:
                    pass
            self.file: IO[bytes] = tempfile.NamedTemporaryFile(prefix="stagesave-export-", suffix=".pt")
            return self.file
        self.remote = None
        self.local = os.path.abspath(os.path.expanduser(self.path))
        if os.path.isdir(self.local):
            raise CliError(f"{self.local} is a folder; give the path of the file to write, e.g. {self.local}/model.ckpt")
        if os.path.exists(self.local) and not self.force:
            raise CliError(f"{self.local} exists; pass --force to replace it")
        parent = os.path.dirname(self.local)
        if not os.path.isdir(parent):
            raise CliError(f"cannot write {self.local}: the folder {parent} does not exist")
        fd, self.tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.local)}.", suffix=".export-tmp", dir=parent)
        self.file = os.fdopen(fd, "wb")
        return self.file

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if self.remote is not None:
            try:
                if exc_type is None:
                    store, name = self.remote
                    self.file.flush()
                    fs = getattr(store, "fs", None)
                    if fs is None:
                        raise CliError(f"cannot upload to {self.path}: the store has no filesystem client")
                    fs.put_file(self.file.name, store.describe(name))
            finally:
                self.file.close()
            return
        try:
            if exc_type is None:
                self.file.flush()
                os.fsync(self.file.fileno())
            self.file.close()
            if exc_type is None:
                os.replace(self.tmp, self.local)
                dfd = os.open(os.path.dirname(self.local), os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        finally:
            if os.path.exists(self.tmp):
                os.unlink(self.tmp)


def export(env: Env, source: str, out_path: str, *, force: bool = False, trusted: bool = False) -> tuple[str, str]:
    """Export ``source`` into the plain torch file ``out_path``; ``(layout name, output path)``.

    Raises:
        CheckpointNotFoundError: ``source`` does not exist.
        IntegrityError: a file does not match its manifest (nothing is written).
        CliError: an unknown layout, or the output exists without ``force``.
    """
    target = env.target(source)
    try:
        ci: CheckpointInfo | None = resolve_target(target.store, target.name, target.is_dir)
    except FileNotFoundError:
        ci = None
    if ci is not None and ci.status == "corrupt":
        raise IntegrityError(f"{target.where} is corrupt: {'; '.join(ci.problems)}; nothing was exported")
    for layout in LAYOUTS:
        if layout.matches(target, ci):
            if ci is None and not isinstance(layout, DcpFolder):
                break
            with _Output(env, out_path, force) as out:
                layout.export(env, target, ci, out, trusted)
            return layout.name, out_path
    known = ", ".join(layout.name for layout in LAYOUTS)
    raise CliError(f"{target.where} is not a checkpoint layout export knows ({known})")


# --------------------------------------------------------------------------- adopt
def _kind(store: Store, name: str, size: int) -> str:
    head = store.read_range(name, 0, 9)
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    if size >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size:
        return "safetensors"
    raise CliError(f"{store.describe(name)} is neither a torch file nor a safetensors file; adopt writes manifests for those only")


def _torch_id(store: Store, name: str, size: int) -> tuple[str | None, int | None]:
    """The torch serialization id recorded in a zip checkpoint, and its byte offset."""
    from ._found import _StoreReader

    try:
        reader = torch._C.PyTorchFileReader(io.BufferedReader(_StoreReader(store, name, size), 1 << 20))
        if not reader.has_record(".data/serialization_id"):  # type: ignore[attr-defined]
            return None, None
        sid = str(reader.serialization_id())
        offset = int(reader.get_record_offset(".data/serialization_id"))  # type: ignore[attr-defined]
    except RuntimeError:
        return None, None
    if not sid.isalnum() or store.read_range(name, offset, len(sid)) != sid.encode():
        return None, None
    return sid, offset


def adopt_file(
    env: Env, target: Target, *, algorithm: str = DEFAULT_ALGORITHM, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    force: bool = False, trusted: bool = False,
) -> tuple[str, CheckpointInfo, bool]:
    """Write a manifest for an existing plain checkpoint.

    Returns:
        The manifest's name, the file's resolved info, and whether a manifest was written
        (``False`` when the file already had a matching one).

    Raises:
        CliError: not a file, not a torch/safetensors file, already has a manifest that does not
            match (without ``force``), or the file changed while it was hashed.
    """
    store, name = target.store, target.name
    if target.is_dir:
        raise CliError(f"{target.where} is a folder; adopt takes one checkpoint file")
    check_algorithm(algorithm)
    if chunk_bytes < ALIGNMENT or chunk_bytes % ALIGNMENT:
        raise CliError(f"--chunk-bytes must be a positive multiple of {ALIGNMENT}", 2)
    ci = resolve(store, name)
    existing = sibling_manifests(store, name)
    if ci.status == "committed":
        assert ci.manifest_name is not None
        return ci.manifest_name, ci, False
    if ci.status == "corrupt" and existing and not force:
        raise CliError(
            f"{target.where} has manifests that do not match it ({'; '.join(ci.problems)}): it may be "
            "corrupt. Check it, then pass --force to replace them with a manifest of its current bytes"
        )
    if ci.status == "corrupt" and not existing:
        raise IntegrityError(f"{target.where} cannot be adopted: {'; '.join(ci.problems)}")
    before = store.info(name)
    if before.size > MAX_FILE_BYTES:
        raise CliError(f"{target.where} is larger than stagesave's limit")
    kind = _kind(store, name, before.size)
    tensors: list[dict[str, Any]] = []
    try:
        tensors = [{"name": t["name"], "dtype": t["dtype"], "shape": t["shape"]}
                   for t in tensor_index(store, name, kind, before.size, trusted=trusted)]
    except Exception as exc:
        if not needs_unsafe_global(exc):
            reason = first_line(exc.__cause__ if isinstance(exc, UnsafeCheckpointError) and exc.__cause__ else exc)
            raise CliError(f"{target.where} cannot be parsed as a {kind} file ({reason}); refusing to certify it") from exc
        env.err.print("note: the tensor index is left out: the file needs classes off the safe allow-list "
                      "(--trusted parses it anyway)", markup=False)
    sid, id_offset = _torch_id(store, name, before.size) if kind == "torch" else (None, None)
    n = (before.size + chunk_bytes - 1) // chunk_bytes
    with env.progress(f"hashing {name}", before.size) as advance:

        def one(i: int) -> str:
            lo = i * chunk_bytes
            data = store.read_range(name, lo, min(chunk_bytes, before.size - lo))
            advance(len(data))
            return digest(algorithm, data)

        with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-adopt") as pool:
            chunks = tuple(pool.map(one, range(n)))
    after = store.info(name)
    if (after.size, after.mtime) != (before.size, before.mtime):
        raise CliError(f"{target.where} changed while it was being hashed; run adopt again once it is complete")
    manifest_id = sid or digest("xxh3_128", "".join(chunks).encode())
    leaf = name.rpartition("/")[2]
    manifest = Manifest(
        files=[FileEntry(leaf, before.size, algorithm, chunk_bytes, chunks, kind, sid, id_offset)],
        created_ns=int(before.mtime * 1e9),
        tensors=tensors,
        metadata={"adopted_by": "stagesave adopt", "adopted_at": time.time()},
    )
    mname = manifest_path_for(name, manifest_id)
    store.put_atomic(mname, manifest.to_json())
    for old in existing:
        if old != mname:
            store.delete(old)
    return mname, resolve(store, name), True


# --------------------------------------------------------------------------- commands
def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="turn a checkpoint (torch/safetensors file, Accelerate or DCP folder) into one plain torch.save file",
        description="Write one plain torch.save file from a checkpoint: a stagesave/torch file (copied "
        "byte for byte, verified), a safetensors file, an Accelerate save_state folder (one key per "
        "file: model, optimizer, scheduler, random_states_0, ...) or a local "
        "torch.distributed.checkpoint folder (--trusted). Files with manifests are verified first.",
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("out", metavar="OUT.ckpt")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--trusted", action="store_true",
                   help="unpickle with the full unpickler (files needing classes off the safe allow-list; DCP metadata)")
    p.set_defaults(func=run_export)

    a = sub.add_parser(
        "adopt",
        help="write a manifest (checksums) for an existing plain checkpoint so it can be verified",
        description="Hash an existing torch or safetensors checkpoint in chunks and write a stagesave "
        "manifest beside it; from then on `verify` and verified loads prove its bytes. The data "
        "file is not modified.",
    )
    a.add_argument("path", metavar="FILE.ckpt")
    a.add_argument("--checksum", default=DEFAULT_ALGORITHM, help="xxh3_128 (default), xxh3_64, blake3 or sha256")
    a.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="checksum chunk size (default 32 MiB)")
    a.add_argument("--force", action="store_true", help="replace manifests that no longer match the file")
    a.add_argument("--trusted", action="store_true", help="parse the file with the full unpickler for the tensor index")
    a.set_defaults(func=run_adopt)


def run_export(env: Env, args: argparse.Namespace) -> int:
    layout, out = export(env, args.path, args.out, force=args.force, trusted=args.trusted)
    size = os.path.getsize(os.path.abspath(out)) if not is_url(out) else None
    env.out.print(f"exported {args.path} ({layout}) to {out}" + (f" ({fmt_bytes(size)})" if size else ""), markup=False)
    return 0


def run_adopt(env: Env, args: argparse.Namespace) -> int:
    target = env.target(args.path)
    mname, ci, written = adopt_file(env, target, algorithm=args.checksum, chunk_bytes=args.chunk_bytes,
                                    force=args.force, trusted=args.trusted)
    if not written:
        env.out.print(f"{ci.path} already has a matching manifest ({mname}); nothing to do", markup=False)
        return 0
    env.out.print(f"adopted {ci.path}: {ci.status}, manifest {mname} ({fmt_bytes(ci.size)})", markup=False)
    return 0
