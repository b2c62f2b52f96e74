"""``stagesave adopt``: a format-1 sidecar manifest for a plain checkpoint stagesave did not write.

The manifest (chunk checksums, torch serialization id, tensor index) is written beside an
existing plain checkpoint that stagesave must not modify, so that ``verify``,
``latest(verify=True)`` and verified loads can prove it from then on; the data file itself is
not touched. A file that already carries its own proof (format 2) is refused, and so is a file
of a folder a format-2 proof covers (a sidecar there would be a file that proof does not list).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import io
import time
from typing import Any

import torch

from ..errors import IntegrityError, UnsafeCheckpointError
from ..ondisk.checksum import DEFAULT_ALGORITHM, check_algorithm, digest
from ..ondisk.manifest import FileEntry, Manifest
from ..ondisk.names import ALIGNMENT, DEFAULT_CHUNK_BYTES, MAX_FILE_BYTES, manifest_name
from ..restore.discovery import CheckpointInfo, resolve
from ..restore.proof import peek, read_proof
from ..stores.base import Store
from ._common import CliError, Env, Target
from ._found import sidecars_of
from ._tensor_index import StoreReader, needs_unsafe_global, tensor_index
from ._units import fmt_bytes
from ._verify import THREADS, first_line

__all__ = ["add_parser", "adopt_file", "run"]


def _kind(store: Store, name: str, size: int) -> str:
    head = store.read_range(name, 0, 9)
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    if size >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size:
        return "safetensors"
    raise CliError(
        f"{store.describe(name)} is neither a torch file nor a safetensors file; adopt writes "
        "manifests for those only"
    )


def _torch_id(store: Store, name: str, size: int) -> tuple[str | None, int | None]:
    """The torch serialization id recorded in a zip checkpoint, and its byte offset."""
    try:
        reader = torch._C.PyTorchFileReader(
            io.BufferedReader(StoreReader(store, name, size), 1 << 20)
        )
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
    env: Env,
    target: Target,
    *,
    algorithm: str = DEFAULT_ALGORITHM,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    force: bool = False,
    trusted: bool = False,
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
                f"{target.where} carries a stagesave proof of its own (format 2) that does not "
                f"check out ({'; '.join(ci.problems)}): it is corrupt, and adopt does not certify "
                "it"
            )
        raise CliError(
            f"{target.where} already carries its own stagesave proof (format 2, seq {ci.seq}): "
            "adopt is for files stagesave did not write; `stagesave verify` checks this one"
        )
    carrier = _in_proven_folder(store, name)
    if carrier is not None and ci.manifest_name is None:
        raise CliError(
            f"{target.where} is a file of a folder checkpoint proven by {store.describe(carrier)}: "
            "a manifest beside it would be a file that proof does not list (the folder would turn "
            "invalid); `stagesave verify` the folder instead"
        )
    existing = [m for m in sidecars_of(store, name) if m != name]
    if ci.status == "committed":
        assert ci.manifest_name is not None
        return ci.manifest_name, ci, False
    if ci.status == "corrupt" and existing and not force:
        raise CliError(
            f"{target.where} has manifests that do not match it ({'; '.join(ci.problems)}): it may "
            "be corrupt. Check it, then pass --force to replace them with a manifest of its "
            "current bytes"
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
            reason = first_line(
                exc.__cause__ if isinstance(exc, UnsafeCheckpointError) and exc.__cause__ else exc
            )
            raise CliError(
                f"{target.where} cannot be parsed as a {kind} file ({reason}); refusing to certify "
                "it"
            ) from exc
        env.say(
            "note: the tensor index is left out: the file needs classes off the safe allow-list "
            "(--trusted parses it anyway)",
            err=True,
        )
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
        raise CliError(
            f"{target.where} changed while it was being hashed; run adopt again once it is complete"
        )
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



def add_parser(sub: Any) -> None:
    a = sub.add_parser(
        "adopt",
        help="write a sidecar manifest (checksums) for a checkpoint stagesave did not write, so it "
             "can be verified",
        description="Hash an existing torch or safetensors checkpoint that stagesave did not write "
        "in chunks and write a stagesave manifest beside it (format 1: a sidecar, since the file "
        "must not be modified); from then on `verify` and verified loads prove its bytes. A file "
        "that already carries its own proof (format 2) is refused. To turn a file into one that "
        "proves itself, use `stagesave migrate` after adopting it.",
    )
    a.add_argument("path", metavar="FILE.ckpt")
    a.add_argument("--checksum", default=DEFAULT_ALGORITHM,
                   help=f"crc32, xxh3_128, xxh3_64, blake3 or sha256 (default {DEFAULT_ALGORITHM})")
    a.add_argument(
        "--chunk-bytes",
        type=int,
        default=DEFAULT_CHUNK_BYTES,
        help="checksum chunk size (default 32 MiB)",
    )
    a.add_argument(
        "--force", action="store_true", help="replace manifests that no longer match the file"
    )
    a.add_argument(
        "--trusted",
        action="store_true",
        help="parse the file with the full unpickler for the tensor index",
    )
    a.set_defaults(func=run)



def run(env: Env, args: argparse.Namespace) -> int:
    target = env.target(args.path)
    mname, ci, written = adopt_file(
        env,
        target,
        algorithm=args.checksum,
        chunk_bytes=args.chunk_bytes,
        force=args.force,
        trusted=args.trusted,
    )
    if not written:
        env.say(f"{ci.path} already has a matching manifest ({mname}); nothing to do")
        return 0
    env.say(f"adopted {ci.path}: {ci.status}, manifest {mname} ({fmt_bytes(ci.size)})")
    return 0
