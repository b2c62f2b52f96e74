"""The two ends of ``stagesave export``: a file read whole into memory and checked against its
proof before anything uses it, and the one output file, published by the core's commit (a byte
copy, or a fresh format-2 file through ``Checkpointer.save``): written under a temporary name,
made durable, renamed into place only once complete.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import io
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from ..checkpointer import Checkpointer
from ..errors import IntegrityError
from ..ondisk.checksum import DEFAULT_ALGORITHM
from ..ondisk.manifest import FileEntry, Manifest
from ..ondisk.names import DEFAULT_CHUNK_BYTES, check_target_name
from ..restore.discovery import CheckpointInfo, resolve_reader
from ..restore.proof import chunk_problems, read_proof
from ..safety import safe_torch_load
from ..saving.commit import copy_file
from ..saving.write import WriteStats
from ..stores.base import Store
from ..stores.targets import is_url
from ._bytes import MemReader, load_bytes
from ._common import CliError, Env

__all__ = [
    "Output", "export_metadata", "load_safetensors_bytes", "load_torch_bytes", "nothing_exported",
    "read_checked",
]


def nothing_exported(where: str, problems: list[str]) -> IntegrityError:
    """The error for a source that does not match its proof: its first problem, and a count."""
    first = problems[0].removeprefix(f"{where}: ")
    more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
    return IntegrityError(f"{where} is corrupt: {first}{more}; nothing was exported")


@contextlib.contextmanager
def read_checked(
    env: Env,
    store: Store,
    name: str,
    pool: cf.Executor,
    proof: Manifest | None = None,
    *,
    own: bool = True,
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
                raise nothing_exported(
                    reader.where, info.problems or ["its proof does not check out"]
                )
            proof = info.manifest
        elif proof is not None and proof.files[0].covered is not None:
            # a folder's member that proves itself: its tail (zip records, header) is checked on
            # these bytes too, and must be the version the folder's carrier pins
            got = read_proof(mem, judged.rpartition("/")[2])
            if got.manifest is None or got.manifest.files[0] != proof.files[0]:
                raise nothing_exported(
                    reader.where, got.problems or ["it is not the version its folder's proof names"]
                )
        if proof is not None:
            entry = proof.files[0]
            if entry.covered is None and entry.size != mem.size:
                raise nothing_exported(
                    reader.where, [f"it is {mem.size} bytes, its proof says {entry.size}"]
                )
            problems = chunk_problems(mem, Manifest([entry], 0), pool)
            if problems:
                raise nothing_exported(reader.where, problems)
        yield loaded.view, proof


def load_torch_bytes(data: memoryview, where: str, trusted: bool) -> Any:
    return safe_torch_load(io.BytesIO(data), map_location="cpu", trusted=trusted, where=where)


def load_safetensors_bytes(data: memoryview) -> dict[str, torch.Tensor]:
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
                raise CliError(
                    f"{local} is a folder; give the path of the file to write, e.g. "
                    f"{local}/model.ckpt"
                )
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
        """Publish ``data`` byte for byte (each chunk checked again against ``proof`` as it
        goes)."""
        if proof is not None:
            entry = proof.files[0]
        else:  # no proof: a plain copy (no chunk to check)
            entry = FileEntry(self.name, len(data), DEFAULT_ALGORITHM, DEFAULT_CHUNK_BYTES, ())
        copy_file(self.store, self.name, data, entry, pool=pool, stats=WriteStats())

    def save(self, state: Any, metadata: dict[str, Any] | None = None) -> None:
        """Write ``state`` as a fresh format-2 torch file (it carries its own proof)."""
        with Checkpointer(self.store, max_pending=1, pinned=False) as ck:
            ck.save(state, self.name, metadata=metadata).result()


def export_metadata(ci: CheckpointInfo | None) -> dict[str, Any] | None:
    if ci is None or ci.manifest is None or not isinstance(ci.manifest.metadata, dict):
        return None
    try:
        json.dumps(ci.manifest.metadata, allow_nan=False)
    except (TypeError, ValueError):
        return None
    return dict(ci.manifest.metadata)
