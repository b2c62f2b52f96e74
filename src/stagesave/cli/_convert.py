"""``stagesave export`` and ``stagesave adopt``: into and out of plain torch files.

``export`` turns a checkpoint of any layout it knows into ONE torch file. Layouts are small
classes in ``LAYOUTS`` (tried in order; the first whose ``matches`` says yes reads the
checkpoint): a single torch file is copied byte for byte (checked against its proof on the
way, never unpickled: a format-2 file's copy proves itself), a single safetensors file becomes
a dict of tensors, an Accelerate ``save_state`` folder becomes ``{"model": ..., "optimizer":
..., "scheduler": ..., ...}``, a sharded folder written by ``stagesave.dcp`` is gathered through
its verifying reader (safe metadata, local or remote), and any other local
``torch.distributed.checkpoint`` folder is read with torch's own reader (its metadata is a
pickle: ``--trusted`` only). Whatever is not a byte copy is written as a fresh format-2 file
(through ``Checkpointer.save``), so every export carries its own proof unless its source had
none. Either way the output is written under a temporary name and published atomically by the
core's commit (``_commit``): nothing appears under the output name until it is complete.

``adopt`` writes a format-1 sidecar manifest (chunk checksums, torch serialization id, tensor
index) beside an existing plain checkpoint that stagesave did not write and must not modify, so
that ``verify``, ``latest(verify=True)`` and verified loads can prove it from then on; the data
file itself is not touched. A file that already carries its own proof (format 2) is refused.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import io
import json
import os
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from ..checkpointer import Checkpointer
from ..errors import IntegrityError, UnsafeCheckpointError
from ..ondisk.checksum import DEFAULT_ALGORITHM, check_algorithm, digest
from ..ondisk.manifest import FileEntry, Manifest
from ..ondisk.names import (
    ALIGNMENT,
    DEFAULT_CHUNK_BYTES,
    MAX_FILE_BYTES,
    check_target_name,
    manifest_name,
)
from ..restore.discovery import CheckpointInfo, folder_entries, resolve, resolve_reader
from ..restore.proof import chunk_problems, peek, read_proof
from ..safety import safe_torch_load
from ..saving.commit import copy_file
from ..saving.write import WriteStats
from ..stores.base import Store
from ..stores.targets import is_url
from ._bytes import MemReader, load_bytes
from ._common import CliError, Env, Target
from ._found import folder_files, needs_unsafe_global, resolve_target, sidecars_of, tensor_index
from ._units import fmt_bytes
from ._verify import THREADS, first_line

__all__ = ["LAYOUTS", "Output", "add_parser", "adopt_file", "export"]


# --------------------------------------------------------------------------- reading, verified
def _nothing_exported(where: str, problems: list[str]) -> IntegrityError:
    first = problems[0].removeprefix(f"{where}: ")
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return IntegrityError(f"{where} is corrupt: {first}{more}; nothing was exported")


@contextlib.contextmanager
def read_checked(
    env: Env, store: Store, name: str, pool: cf.Executor, proof: Manifest | None = None, *, own: bool = True,
) -> Iterator[tuple[memoryview, Manifest | None]]:
    """A whole file in memory, checked against its proof before anything uses it.

    ``own``: the file proves itself (format 2) or has a sidecar (format 1): its proof is read
    from the very bytes read (one version). Otherwise ``proof`` (what a folder's carrier pins
    for it, or ``None``: no proof) is the one to check against.

    Yields the bytes and the proof they were checked against (``None``: no proof to check).

    Raises:
        IntegrityError: the file does not match its proof (nothing was exported).
    """
    judged = store.canonical(name)
    with store.open(judged) as reader, env.progress(f"reading {name}", reader.size) as advance, \
            load_bytes(reader, pool=pool, advance=advance, mapped=True) as loaded:
        mem = MemReader(loaded.view, reader.where, judged, reader.mtime)
        if own:
            info = resolve_reader(store, judged, mem)
            if info.status == "corrupt":
                raise _nothing_exported(reader.where, info.problems or ["its proof does not check out"])
            proof = info.manifest
        elif proof is not None and proof.files[0].covered is not None:
            # a folder's member that proves itself: its tail (zip records, header) is checked on
            # these bytes too, and must be the version the folder's carrier pins
            got = read_proof(mem, judged.rpartition("/")[2])
            if got.manifest is None or got.manifest.files[0] != proof.files[0]:
                raise _nothing_exported(reader.where, got.problems or ["it is not the version its folder's proof names"])
        if proof is not None:
            entry = proof.files[0]
            if entry.covered is None and entry.size != mem.size:
                raise _nothing_exported(reader.where, [f"it is {mem.size} bytes, its proof says {entry.size}"])
            problems = chunk_problems(mem, Manifest([entry], 0), pool)
            if problems:
                raise _nothing_exported(reader.where, problems)
        yield loaded.view, proof


def _load_torch_bytes(data: memoryview, where: str, trusted: bool) -> Any:
    return safe_torch_load(io.BytesIO(data), map_location="cpu", trusted=trusted, where=where)


def _load_safetensors_bytes(data: memoryview) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    loaded = load(bytes(data))
    return {k: loaded[k] for k in sorted(loaded)}  # deterministic order, whatever the file's


# --------------------------------------------------------------------------- output
class Output:
    """Where an export goes: a byte copy (``copy``) or a fresh format-2 file (``save``), both
    committed by the core (temporary name, durable, atomic publish)."""

    def __init__(self, env: Env, path: str, force: bool) -> None:
        self.env, self.path = env, path
        if is_url(path):
            self.store, self.name = env.resolver.split(path)
            exists = self._exists()
        else:
            local = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
            if os.path.isdir(local):
                raise CliError(f"{local} is a folder; give the path of the file to write, e.g. {local}/model.ckpt")
            parent = os.path.dirname(local)
            if not os.path.isdir(parent):
                raise CliError(f"cannot write {local}: the folder {parent} does not exist")
            self.path = local
            self.store, self.name = env.resolver.split(local)
            exists = os.path.lexists(local)
        if exists and not force:
            raise CliError(f"{self.path} exists; pass --force to replace it")
        try:
            check_target_name(self.name)
        except ValueError as exc:
            raise CliError(str(exc), 2) from exc

    def _exists(self) -> bool:
        try:
            self.store.info(self.name)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        except IsADirectoryError as exc:
            raise CliError(f"{self.path} is a folder; give the path of the file to write") from exc

    def copy(self, data: memoryview, proof: Manifest | None, pool: cf.Executor) -> None:
        """Publish ``data`` byte for byte (each chunk checked again against ``proof`` as it goes)."""
        if proof is not None:
            entry = proof.files[0]
        else:  # no proof: a plain copy (no chunk to check)
            entry = FileEntry(self.name, len(data), DEFAULT_ALGORITHM, DEFAULT_CHUNK_BYTES, ())
        copy_file(self.store, self.name, data, entry, pool=pool, stats=WriteStats())

    def save(self, state: Any, metadata: dict[str, Any] | None = None) -> None:
        """Write ``state`` as a fresh format-2 torch file (it carries its own proof)."""
        with Checkpointer(self.store, max_pending=1, pinned=False) as ck:
            ck.save(state, self.name, metadata=metadata).result()


def _metadata(ci: CheckpointInfo | None) -> dict[str, Any] | None:
    if ci is None or ci.manifest is None or not isinstance(ci.manifest.metadata, dict):
        return None
    try:
        json.dumps(ci.manifest.metadata, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return dict(ci.manifest.metadata)


# --------------------------------------------------------------------------- layouts
class Layout:
    """A checkpoint layout ``export`` can read. Subclasses set ``name`` and implement both."""

    name: ClassVar[str] = ""

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        raise TypeError(f"{type(self).__name__} does not implement matches()")

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool) -> None:
        """Write the checkpoint as one torch file through ``out``."""
        raise TypeError(f"{type(self).__name__} does not implement export()")


class TorchFile(Layout):
    """A single torch file (stagesave's or plain): copied byte for byte, checked on the way."""

    name = "torch file"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        if target.is_dir or target.name.endswith(".safetensors"):
            return False
        head = target.store.read_range(target.name, 0, 4)
        return head == b"PK\x03\x04" or head[:1] == b"\x80"  # a zip, or a legacy pickle

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool) -> None:
        with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-export") as pool, \
                read_checked(env, target.store, target.name, pool) as (data, proof):
            if proof is None or proof.folder is None:
                out.copy(data, proof, pool)
                return
            # one file of a folder checkpoint: its proof names its folder, so a byte copy would be
            # a loose member wherever it goes; it becomes a checkpoint of its own instead
            state = _load_torch_bytes(data, target.where, trusted)
        out.save(state, _metadata(ci))


class SafetensorsFile(Layout):
    """A single safetensors file: becomes a dict of tensors."""

    name = "safetensors file"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        return not target.is_dir and target.name.endswith(".safetensors")

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool) -> None:
        with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-export") as pool, \
                read_checked(env, target.store, target.name, pool) as (data, _):
            state = _load_safetensors_bytes(data)
        out.save(state, _metadata(ci))


def _folder_proofs(store: Store, ci: CheckpointInfo | None) -> dict[str, Manifest] | None:
    """What proves each file of a folder checkpoint (``None``: the folder has no proof).

    Raises:
        IntegrityError: a file of the folder is not the one its proof names.
    """
    if ci is None or ci.manifest is None:
        return None
    entries, problems = folder_entries(store, ci)
    if problems:
        raise _nothing_exported(ci.path, problems)
    out = {}
    for fname, own, listed in entries:
        if own is not None:
            out[fname] = own
        elif listed is not None:
            out[fname] = Manifest([listed], 0)
    return out


class AccelerateFolder(Layout):
    """An Accelerate ``save_state`` folder (with or without a stagesave proof).

    Each file becomes one key, named after it: ``model.safetensors`` / ``pytorch_model.bin`` ->
    ``model``, ``model_1.safetensors`` -> ``model_1``, ``optimizer.bin`` -> ``optimizer``,
    ``random_states_0.pkl`` -> ``random_states_0``; a sharded model (``*.index.json``) is
    merged back into one state dict. Files of a proven folder are checked against their proofs.
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

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool) -> None:
        store = target.store
        proofs = _folder_proofs(store, ci)
        files = {f.name.rpartition("/")[2]: f for f in folder_files(store, target.name)}
        indexes = [f for f in store.list(target.name) if f.name.endswith(self._INDEX)]
        state: dict[str, Any] = {}
        with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-export") as pool:

            def read(fname: str) -> contextlib.AbstractContextManager[tuple[memoryview, Manifest | None]]:
                proof = proofs.get(fname.rpartition("/")[2]) if proofs is not None else None
                return read_checked(env, store, fname, pool, proof, own=False)

            shard_of: dict[str, str] = {}
            for f in indexes:
                leaf = f.name.rpartition("/")[2]
                with read(f.name) as (data, _):
                    index = json.loads(bytes(data))
                weight_map = index.get("weight_map", {}) if isinstance(index, dict) else {}
                model = self.key_for(leaf[: -len(self._INDEX)] + ".safetensors")
                for shard in set(weight_map.values()) if isinstance(weight_map, dict) else ():
                    shard_of[str(shard)] = model
            for leaf in sorted(files):
                f = files[leaf]
                with read(f.name) as (data, _):
                    if leaf.endswith(".safetensors"):
                        tensors = _load_safetensors_bytes(data)
                        if leaf in shard_of:
                            state.setdefault(shard_of[leaf], {}).update(tensors)
                        else:
                            state[self.key_for(leaf)] = tensors
                    else:
                        state[self.key_for(leaf)] = _load_torch_bytes(data, store.describe(f.name), trusted)
        out.save(state, _metadata(ci))


def _folder_names(ci: CheckpointInfo | None) -> set[str]:
    if ci is None or ci.manifest is None:
        return set()
    m = ci.manifest
    return m.folder.names() if m.folder is not None else {f.name for f in m.files}


class StagedDcpFolder(Layout):
    """A sharded checkpoint written by ``stagesave.dcp``: every rank file verified against its
    proof, metadata read with the safe allow-list (no ``--trusted`` needed), local or remote."""

    name = "stagesave sharded (torch.distributed.checkpoint) folder"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        return target.is_dir and ".metadata" in _folder_names(ci)

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool) -> None:
        from stagesave.dcp import to_state_dict

        state = to_state_dict(target.name, store=target.store, trusted=trusted)
        out.save(state, _metadata(ci))


class DcpFolder(Layout):
    """A local ``torch.distributed.checkpoint`` folder (``.metadata`` + ``*.distcp``), through
    torch's own reader. Its metadata is a pickle, so ``--trusted`` is required."""

    name = "torch.distributed.checkpoint folder"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        if not target.is_dir:
            return False
        return any(f.name.rpartition("/")[2] == ".metadata" for f in target.store.list(target.name))

    def export(self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool) -> None:
        local = target.store.local_path(target.name)
        if local is None:
            raise CliError(f"{target.where}: export reads torch.distributed.checkpoint folders from local disk only; copy it locally first")
        if not trusted:
            raise UnsafeCheckpointError(
                f"refusing to read {target.where}: torch.distributed.checkpoint metadata is a plain "
                "pickle and unpickling it could run code; pass --trusted if you trust its source"
            )
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state: dict[str, Any] = {}  # what torch's dcp_to_torch_save does, kept in memory
        _load_state_dict(state, storage_reader=FileSystemReader(local),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)  # type: ignore[no-untyped-call]
        out.save(state)


#: Tried in order; the first layout whose ``matches`` is true exports the checkpoint.
LAYOUTS: list[Layout] = [StagedDcpFolder(), DcpFolder(), TorchFile(), SafetensorsFile(), AccelerateFolder()]


def export(env: Env, source: str, out_path: str, *, force: bool = False, trusted: bool = False) -> tuple[str, str]:
    """Export ``source`` into the torch file ``out_path``; ``(layout name, output path)``.

    Raises:
        CheckpointNotFoundError: ``source`` does not exist.
        IntegrityError: a file does not match its proof (nothing is written).
        CliError: an unknown layout, or the output exists without ``force``.
    """
    target = env.target(source)
    try:
        ci: CheckpointInfo | None = resolve_target(target.store, target.name, target.is_dir)
    except FileNotFoundError:
        ci = None
    if ci is not None and ci.status == "corrupt":
        raise _nothing_exported(target.where, ci.problems or ["its proof does not check out"])
    for layout in LAYOUTS:
        if layout.matches(target, ci):
            if ci is None and not isinstance(layout, DcpFolder):
                break
            out = Output(env, out_path, force)
            layout.export(env, target, ci, out, trusted)
            return layout.name, out.path
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


def _in_proven_folder(store: Store, name: str) -> str | None:
    """The sibling whose format-2 proof makes ``name``'s folder one checkpoint (a sidecar there
    would be a file the proof does not list: the folder would turn invalid), or ``None``.

    The first sibling that carries a format-2 proof tells: the files of a folder checkpoint all
    name their folder, a standalone checkpoint in a root does not.
    """
    directory = name.rpartition("/")[0]
    for info in store.list(directory):
        leaf = info.name.rpartition("/")[2]
        if info.name == name or not leaf.endswith((".safetensors", *_TORCH_SUFFIXES, ".metadata")):
            continue
        try:
            with store.open(info.name) as reader:
                p = peek(reader)
                if p.format == 2 and p.summary is not None:
                    return info.name if p.summary.folder is not None else None
                if leaf.endswith(".safetensors"):
                    got = read_proof(reader, leaf)
                    if got.manifest is not None:
                        return info.name if got.manifest.folder is not None else None
        except OSError:
            continue
    return None


_TORCH_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".tar", ".pkl", ".distcp")


def adopt_file(
    env: Env, target: Target, *, algorithm: str = DEFAULT_ALGORITHM, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    force: bool = False, trusted: bool = False,
) -> tuple[str, CheckpointInfo, bool]:
    """Write a format-1 sidecar manifest for an existing plain checkpoint (stagesave did not
    write it and must not modify it).

    Returns:
        The manifest's name, the file's resolved info, and whether a manifest was written
        (``False`` when the file already had a matching one).

    Raises:
        CliError: not a file, not a torch/safetensors file, a file that carries its own proof
            (format 2) or lies in a folder proven by one, already has a manifest that does not
            match (without ``force``), or the file changed while it was hashed.
    """
    store, name = target.store, target.name
    if target.is_dir:
        raise CliError(f"{target.where} is a folder; adopt takes one checkpoint file")
    check_algorithm(algorithm)
    if chunk_bytes < ALIGNMENT or chunk_bytes % ALIGNMENT:
        raise CliError(f"--chunk-bytes must be a positive multiple of {ALIGNMENT}", 2)
    ci = resolve(store, name)
    if ci.format == 2:
        if ci.status == "corrupt":
            raise CliError(
                f"{target.where} carries a stagesave proof of its own (format 2) that does not check out "
                f"({'; '.join(ci.problems)}): it is corrupt, and adopt does not certify it"
            )
        raise CliError(
            f"{target.where} already carries its own stagesave proof (format 2, seq {ci.seq}): adopt is for "
            "files stagesave did not write; `stagesave verify` checks this one"
        )
    carrier = _in_proven_folder(store, name)
    if carrier is not None and ci.manifest_name is None:
        raise CliError(
            f"{target.where} is a file of a folder checkpoint proven by {store.describe(carrier)}: a manifest "
            "beside it would be a file that proof does not list (the folder would turn invalid); "
            "`stagesave verify` the folder instead"
        )
    existing = [m for m in sidecars_of(store, name) if m != name]
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
        env.say("note: the tensor index is left out: the file needs classes off the safe allow-list "
                "(--trusted parses it anyway)", err=True)
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
    mname = manifest_name(name, manifest_id)
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
        description="Write one torch.save file from a checkpoint: a stagesave/torch file (copied byte "
        "for byte, checked against its proof: a format-2 copy proves itself), a safetensors file, an "
        "Accelerate save_state folder (one key per file: model, optimizer, scheduler, "
        "random_states_0, ...), a stagesave sharded folder or a local torch.distributed.checkpoint "
        "folder (--trusted); all but byte copies are written as fresh format-2 files. Files with a "
        "proof are checked before anything is written; the output appears only once complete.",
    )
    p.add_argument("path", metavar="PATH")
    p.add_argument("out", metavar="OUT.ckpt")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--trusted", action="store_true",
                   help="unpickle with the full unpickler (files needing classes off the safe allow-list; DCP metadata)")
    p.set_defaults(func=run_export)

    a = sub.add_parser(
        "adopt",
        help="write a sidecar manifest (checksums) for a checkpoint stagesave did not write, so it can be verified",
        description="Hash an existing torch or safetensors checkpoint that stagesave did not write in "
        "chunks and write a stagesave manifest beside it (format 1: a sidecar, since the file must "
        "not be modified); from then on `verify` and verified loads prove its bytes. A file that "
        "already carries its own proof (format 2) is refused. To turn a file into one that proves "
        "itself, use `stagesave migrate` after adopting it.",
    )
    a.add_argument("path", metavar="FILE.ckpt")
    a.add_argument("--checksum", default=DEFAULT_ALGORITHM,
                   help=f"crc32, xxh3_128, xxh3_64, blake3 or sha256 (default {DEFAULT_ALGORITHM})")
    a.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="checksum chunk size (default 32 MiB)")
    a.add_argument("--force", action="store_true", help="replace manifests that no longer match the file")
    a.add_argument("--trusted", action="store_true", help="parse the file with the full unpickler for the tensor index")
    a.set_defaults(func=run_adopt)


def run_export(env: Env, args: argparse.Namespace) -> int:
    layout, out = export(env, args.path, args.out, force=args.force, trusted=args.trusted)
    size = os.path.getsize(os.path.abspath(out)) if not is_url(out) else None
    env.say(f"exported {args.path} ({layout}) to {out}" + (f" ({fmt_bytes(size)})" if size else ""))
    return 0


def run_adopt(env: Env, args: argparse.Namespace) -> int:
    target = env.target(args.path)
    mname, ci, written = adopt_file(env, target, algorithm=args.checksum, chunk_bytes=args.chunk_bytes,
                                    force=args.force, trusted=args.trusted)
    if not written:
        env.say(f"{ci.path} already has a matching manifest ({mname}); nothing to do")
        return 0
    env.say(f"adopted {ci.path}: {ci.status}, manifest {mname} ({fmt_bytes(ci.size)})")
    return 0
