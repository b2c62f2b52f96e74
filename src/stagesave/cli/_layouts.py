"""The checkpoint layouts ``stagesave export`` reads, one small class each.

Tried in the order of ``LAYOUTS``; the first whose ``matches`` says yes reads the checkpoint:
a sharded folder written by ``stagesave.dcp`` (through its verifying reader, safe metadata,
local or remote), any other local ``torch.distributed.checkpoint`` folder (torch's own reader:
its metadata is a pickle, ``--trusted`` only), a single torch file (copied byte for byte,
checked against its proof on the way, never unpickled), a single safetensors file (a dict of
tensors) and an Accelerate ``save_state`` folder (``{"model": ..., "optimizer": ...,
"scheduler": ..., ...}``). A new layout is a subclass with ``matches()`` and ``export()``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
from typing import Any, ClassVar

from ..errors import UnsafeCheckpointError
from ..ondisk.manifest import Manifest
from ..restore.discovery import CheckpointInfo, folder_entries
from ..stores.base import Store
from ._common import CliError, Env, Target
from ._export_io import (
    Output,
    export_metadata,
    load_safetensors_bytes,
    load_torch_bytes,
    nothing_exported,
    read_checked,
)
from ._found import folder_files
from ._verify import THREADS

__all__ = [
    "LAYOUTS", "AccelerateFolder", "DcpFolder", "Layout", "SafetensorsFile", "StagedDcpFolder",
    "TorchFile",
]


class Layout:
    """A checkpoint layout ``export`` can read. Subclasses set ``name`` and implement both."""

    name: ClassVar[str] = ""

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        raise TypeError(f"{type(self).__name__} does not implement matches()")

    def export(
        self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool
    ) -> None:
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

    def export(
        self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool
    ) -> None:
        with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-export") as pool, \
                read_checked(env, target.store, target.name, pool) as (data, proof):
            if proof is None or proof.folder is None:
                out.copy(data, proof, pool)
                return
            # one file of a folder checkpoint: its proof names its folder, so a byte copy would be
            # a loose member wherever it goes; it becomes a checkpoint of its own instead
            state = load_torch_bytes(data, target.where, trusted)
        out.save(state, export_metadata(ci))


class SafetensorsFile(Layout):
    """A single safetensors file: becomes a dict of tensors."""

    name = "safetensors file"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        return not target.is_dir and target.name.endswith(".safetensors")

    def export(
        self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool
    ) -> None:
        with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-export") as pool, \
                read_checked(env, target.store, target.name, pool) as (data, _):
            state = load_safetensors_bytes(data)
        out.save(state, export_metadata(ci))


def _folder_proofs(store: Store, ci: CheckpointInfo | None) -> dict[str, Manifest] | None:
    """What proves each file of a folder checkpoint (``None``: the folder has no proof).

    Raises:
        IntegrityError: a file of the folder is not the one its proof names.
    """
    if ci is None or ci.manifest is None:
        return None
    entries, problems = folder_entries(store, ci)
    if problems:
        raise nothing_exported(ci.path, problems)
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
        return any(
            f.name.endswith((".safetensors", ".bin", ".pkl", ".pt"))
            for f in target.store.list(target.name)
        )

    @staticmethod
    def key_for(leaf: str) -> str:
        stem = leaf.rsplit(".", 1)[0]
        if stem.startswith("pytorch_model"):
            stem = "model" + stem[len("pytorch_model") :]
        return stem

    def export(
        self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool
    ) -> None:
        store = target.store
        proofs = _folder_proofs(store, ci)
        files = {f.name.rpartition("/")[2]: f for f in folder_files(store, target.name)}
        indexes = [f for f in store.list(target.name) if f.name.endswith(self._INDEX)]
        if proofs is not None:  # files beside a checkpoint are the user's: not part of it
            skipped = sorted({*files, *(f.name.rpartition("/")[2] for f in indexes)} - {*proofs})
            files = {leaf: f for leaf, f in files.items() if leaf in proofs}
            indexes = [f for f in indexes if f.name.rpartition("/")[2] in proofs]
            if skipped:
                env.say(f"note: not exported (beside the checkpoint, not part of it): "
                        f"{', '.join(skipped)}", err=True)
        state: dict[str, Any] = {}
        with cf.ThreadPoolExecutor(THREADS, thread_name_prefix="stagesave-export") as pool:

            def read(
                fname: str,
            ) -> contextlib.AbstractContextManager[tuple[memoryview, Manifest | None]]:
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
                        tensors = load_safetensors_bytes(data)
                        if leaf in shard_of:
                            state.setdefault(shard_of[leaf], {}).update(tensors)
                        else:
                            state[self.key_for(leaf)] = tensors
                    else:
                        state[self.key_for(leaf)] = load_torch_bytes(
                            data, store.describe(f.name), trusted
                        )
        out.save(state, export_metadata(ci))


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

    def export(
        self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool
    ) -> None:
        from stagesave.dcp import to_state_dict

        state = to_state_dict(target.name, store=target.store, trusted=trusted)
        out.save(state, export_metadata(ci))


class DcpFolder(Layout):
    """A local ``torch.distributed.checkpoint`` folder (``.metadata`` + ``*.distcp``), through
    torch's own reader. Its metadata is a pickle, so ``--trusted`` is required."""

    name = "torch.distributed.checkpoint folder"

    def matches(self, target: Target, ci: CheckpointInfo | None) -> bool:
        if not target.is_dir:
            return False
        return any(f.name.rpartition("/")[2] == ".metadata" for f in target.store.list(target.name))

    def export(
        self, env: Env, target: Target, ci: CheckpointInfo | None, out: Output, trusted: bool
    ) -> None:
        local = target.store.local_path(target.name)
        if local is None:
            raise CliError(
                f"{target.where}: export reads torch.distributed.checkpoint folders from local "
                "disk only; copy it locally first"
            )
        if not trusted:
            raise UnsafeCheckpointError(
                f"refusing to read {target.where}: torch.distributed.checkpoint metadata is a "
                "plain pickle and unpickling it could run code; pass --trusted if you trust its "
                "source"
            )
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        state: dict[str, Any] = {}  # what torch's dcp_to_torch_save does, kept in memory
        _load_state_dict(state, storage_reader=FileSystemReader(local),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)  # type: ignore[no-untyped-call]
        out.save(state)


#: Tried in order; the first layout whose ``matches`` is true exports the checkpoint.
LAYOUTS: list[Layout] = [
    StagedDcpFolder(),
    DcpFolder(),
    TorchFile(),
    SafetensorsFile(),
    AccelerateFolder(),
]
