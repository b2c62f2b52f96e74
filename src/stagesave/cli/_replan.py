"""Re-planning a verified format-1 checkpoint as format-2 file images, without unpickling.

A torch file's own zip is parsed and its bytes become the file image as they are (storages at
their record offsets, every record given its real CRC-32); a safetensors file of a folder is
laid out again with room for its proof (same tensors, same metadata); any other file of a
folder is kept byte for byte as a raw file the folder's proof lists. ``stagesave migrate``
(``_migrate.py``) commits what is planned here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

from ..formats import Safetensors
from ..ondisk.checksum import crc32
from ..ondisk.manifest import FileEntry, StorageRecord
from ..ondisk.names import ALIGNMENT, PROOF_KEY
from ..ondisk.torchzip import TorchZip, ZipFormatError, parse_torch_zip
from ..saving.buffers import HostBuffer
from ..saving.plan import FileImage, StorageSlot, TensorEntry
from ..saving.plan_folder import folder_bound
from ..saving.stage import stage_image
from ..saving.write import FileToWrite, proof_room

__all__ = ["NotMigratable", "folder_rooms", "safetensors_content", "staged", "torch_image"]

#: Largest tensor-index entry count carried over (the core's own cap on what it indexes).
_MAX_INDEX = 200_000


class NotMigratable(Exception):
    """This checkpoint cannot be migrated, for the reason given (it is left as it is)."""

    def __init__(self, message: str, action: str = "failed") -> None:
        super().__init__(message)
        self.action = action



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
        if not (
            isinstance(name, str)
            and isinstance(dtype, str)
            and isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
            and isinstance(stride, list)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in stride)
        ):
            continue
        out.append(
            TensorEntry(
                name=name,
                storage_key=storage if isinstance(storage, str) else None,  # type: ignore[arg-type]
                dtype=dtype,
                shape=tuple(shape),
                stride=tuple(stride),
                storage_offset=offset
                if isinstance(offset, int) and not isinstance(offset, bool)
                else None,  # type: ignore[arg-type]
            )
        )
    return out


def torch_image(
    buf: HostBuffer, size: int, entry: FileEntry, tensors: Any, where: str
) -> FileImage:
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
            f"{where} is not a zip torch file ({exc}; a legacy torch.save file?): it cannot carry "
            "a proof inside; it keeps its sidecar",
            "skipped",
        ) from exc
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
            raise NotMigratable(
                f"{where}: storage {st.key} of its manifest is not a record of its zip"
            )
        slots.append(
            StorageSlot(st.key, st.offset, st.nbytes, buf.tensor[st.offset : st.offset + st.nbytes])
        )
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
        size=size,
        pieces=[],
        slots=slots,
        serialization_id=sid,
        id_offset=id_offset,
        tensors=_index(tensors),
        kind="torch",
        zip=zip_,
        crc_fields=[by_name[data + s.key].descriptor_crc_at for s in slots],
    )


def folder_rooms(
    files: Sequence[tuple[str, FileImage | None, Any]],
    algorithm: str,
    chunk_bytes: int,
    metadata: dict[str, Any],
) -> dict[str, Any]:
    """The proof room of each safetensors file of a folder (mirrors ``Checkpointer._plan_folder``):
    the carrier's must hold the folder's list of files, the others only their own proof."""
    planned = {n: im for n, im, _ in files if im is not None}
    st = [n for n, im, _ in files if im is None]
    st_carrier = st[0] if st and not any(im.kind == "torch" for im in planned.values()) else None
    bound = folder_bound([n for n, _, _ in files], planned, algorithm, chunk_bytes)
    rooms = {}
    for n in st:
        carrier = n == st_carrier
        folder = bound if carrier else {"token": "f" * 32, "carrier": "x" * 255}
        meta = metadata if carrier else {}

        def room(size: int, storages: list[list[object]], folder: dict[str, Any] = folder,
                 meta: dict[str, Any] = meta) -> int:
            return proof_room(
                size,
                storages,
                algorithm=algorithm,
                chunk_bytes=chunk_bytes,
                metadata=meta,
                folder=folder,
            )

        rooms[n] = room
    return rooms


def safetensors_content(buf: HostBuffer, size: int, where: str) -> Safetensors:
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


def staged(name: str, image: FileImage, buffers: list[HostBuffer]) -> FileToWrite:
    """``image`` copied into a page-aligned buffer of its own (kept in ``buffers``)."""
    buf = HostBuffer.allocate(_round_up(image.size), pinned=False)
    buffers.append(buf)
    stage_image(image, buf)
    return FileToWrite(name, image, buf.view, None, None, name)
