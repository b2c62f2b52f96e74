"""What a trainer and its writer agent say to each other, over the socket pair the agent was
started with (unnamed: no other process can connect to it).

Every message is a length-prefixed pickle. Only the agent's own trainer holds the other end, so
the agent unpickles what it reads; it never reads anything else. The trainer reads the agent's
replies as plain tuples of numbers and strings.
"""

from __future__ import annotations

import operator
import pickle
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..ondisk.torchzip import TorchZip, ZipRecord
from ..saving.files import ImageCrcs
from ..saving.image import FileImage, StorageSlot, TensorEntry
from ..saving.index_json import IndexJson
from ..stores.base import Store

__all__ = [
    "LayoutCodec", "Order", "OrderFile", "Reply", "dumps", "recv", "send", "send_bytes",
]

_LEN = struct.Struct("<Q")


def dumps(message: object) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def send_bytes(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def send(sock: socket.socket, message: object) -> None:
    send_bytes(sock, dumps(message))


def recv(sock: socket.socket) -> Any:
    """The next message; ``None`` when the other end is gone."""
    head = _recv_exactly(sock, _LEN.size)
    if head is None:
        return None
    body = _recv_exactly(sock, _LEN.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    out = bytearray(n)
    view = memoryview(out)
    got = 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except (ConnectionResetError, OSError):
            return None
        if k == 0:
            return None
        got += k
    return bytes(out)


def _detached_slot(key: str, offset: int, nbytes: int) -> StorageSlot:
    return StorageSlot(key, offset, nbytes, device_type="cpu", address=0)


#: Bytes of a central directory compared (and resent) at a time.
_CD_BLOCK = 8 << 10


class LayoutCodec:
    """The layout of each file an order carries, sent as a change to the last one sent for the
    same file key (a checkpoint's own file, or a folder's ``optimizer.bin``, ...).

    From the second save on, a reused plan (:mod:`stagesave.saving.steady`) hands out the very
    same slot, index and CRC-field lists while the structure stays the same (it copies a list
    before changing it: a list it handed out is never changed), and the same zip records but
    for a few: an order then carries a few kilobytes where the whole layout of 100,000 tensors
    is ~24 MB and ~1.5 s to pickle. The encoder keeps what it sent last (so no object it
    compares by identity can be collected and its id reused); the agent's decoder keeps what it
    received. Both see the orders in the same sequence (one socket, one lock).
    """

    def __init__(self) -> None:
        self.last: dict[tuple[str, str], Any] = {}
        #: The agent's encoded tensor index per file key (encoded again when the entries are
        #: not the very ones it encoded: :class:`.IndexJson`).
        self.index_json: dict[str, IndexJson] = {}

    # ------------------------------------------------------------------ trainer's side
    def _same_object(self, key: tuple[str, str], new: Any,
                     full: Callable[[Any], Any]) -> tuple[Any, ...]:
        old = self.last.get(key)
        self.last[key] = new
        return ("same",) if old is new else ("full", full(new))

    def _records(self, key: tuple[str, str], new: tuple[Any, ...]) -> tuple[Any, ...]:
        old = self.last.get(key)
        self.last[key] = new
        if old is None or len(old) != len(new):
            return ("full", new)
        same = list(map(operator.is_, new, old))
        if all(same):
            return ("same",)
        changed = [(i, new[i]) for i, s in enumerate(same) if not s]
        return ("patch", changed) if len(changed) * 4 < len(new) else ("full", new)

    @staticmethod
    def _plain_records(change: tuple[Any, ...]) -> tuple[Any, ...]:
        """Zip records as plain tuples (a dataclass pickles through a Python call each: 0.2 s
        for 100,000 records)."""
        if change[0] == "full":
            return ("full", tuple(map(_record_tuple, change[1])))
        if change[0] == "patch":
            return ("patch", [(i, _record_tuple(r)) for i, r in change[1]])
        return change

    def _cd(self, key: tuple[str, str], new: bytes) -> tuple[Any, ...]:
        old = self.last.get(key)
        self.last[key] = new
        if old is None or len(old) != len(new):
            return ("full", new)
        blocks = [(i, new[i : i + _CD_BLOCK]) for i in range(0, len(new), _CD_BLOCK)
                  if new[i : i + _CD_BLOCK] != old[i : i + _CD_BLOCK]]
        return ("patch", blocks)

    def encode(self, file_key: str, image: FileImage) -> dict[str, Any]:
        """What the agent needs of ``image`` (nothing of the state), as changes."""
        z = image.zip
        return {
            "size": image.size, "serialization_id": image.serialization_id,
            "id_offset": image.id_offset, "kind": image.kind, "blank": image.blank,
            "gapless": image.gapless, "counts": (image.tensor_bytes, image.nonempty_slots),
            "slots": self._same_object(("slots", file_key), image.slots,
                                       lambda ss: [(s.key, s.offset, s.nbytes) for s in ss]),
            # plain tuples: a named tuple pickles through a Python call each
            "tensors": self._same_object(("tensors", file_key), image.tensors,
                                         lambda ts: list(map(tuple, ts))),
            "crc_fields": self._same_object(("crc_fields", file_key), image.crc_fields, list),
            "zip": None if z is None else (
                z.prefix, z.cd_start, z.zip64,
                self._plain_records(self._records(("records", file_key), z.records)),
                self._cd(("cd", file_key), z.cd)),
        }

    # ------------------------------------------------------------------ agent's side
    def _apply(self, key: tuple[str, str], change: tuple[Any, ...],
               make: Callable[[Any], Any] | None = None) -> Any:
        if change[0] == "full":
            value = change[1] if make is None else tuple(make(x) for x in change[1])
        elif change[0] == "same":
            value = self.last[key]
        elif isinstance(self.last[key], bytes):
            buf = bytearray(self.last[key])
            for at, block in change[1]:
                buf[at : at + len(block)] = block
            value = bytes(buf)
        else:
            items = list(self.last[key])
            for i, item in change[1]:
                items[i] = item if make is None else make(item)
            value = tuple(items)
        self.last[key] = value
        return value

    def decode(self, file_key: str, got: dict[str, Any]) -> FileImage:
        """The image the trainer encoded (its slots are places in the file only)."""
        zip_ = None
        if got["zip"] is not None:
            prefix, cd_start, zip64, records, cd = got["zip"]
            zip_ = TorchZip(prefix, tuple(self._apply(("records", file_key), records,
                                                      lambda t: ZipRecord(*t))),
                            cd_start, self._apply(("cd", file_key), cd), zip64)
        slots = self._apply(("slots", file_key), got["slots"])
        return FileImage(
            size=got["size"], pieces=(),
            slots=[_detached_slot(k, o, n) for k, o, n in slots],
            serialization_id=got["serialization_id"], id_offset=got["id_offset"],
            tensors=list(self._apply(("tensors", file_key), got["tensors"], TensorEntry._make)),
            kind=got["kind"],
            zip=zip_, crc_fields=list(self._apply(("crc_fields", file_key), got["crc_fields"])),
            blank=got["blank"], gapless=got["gapless"], counts=got["counts"],
            index_json=self.index_json.setdefault(file_key, IndexJson()),
        )


def _record_tuple(r: ZipRecord) -> tuple[Any, ...]:
    return (r.name, r.header_offset, r.data_offset, r.size, r.descriptor_crc_at, r.cd_entry_at)


@dataclass
class OrderFile:
    """One staged file of an order: its layout (:class:`LayoutCodec`), where it sits in the
    segment, its CRCs."""

    name: str
    key: str  # whose last layout this one's changes are to
    layout: dict[str, Any]
    offset: int
    crcs: ImageCrcs | None
    entry_name: str | None


@dataclass
class Order:
    """One save handed to the agent: everything its job needs, and nothing of the state."""

    id: int
    kind: str  # "file" or "folder"
    store: Store
    name: str
    segment: str
    files: list[OrderFile]
    checksum: str
    chunk_bytes: int
    keep_last: int | None
    meta: dict[str, Any]
    telemetry: dict[str, Any]
    t_start: float
    staging_dir: str | None = None
    nested: list[str] = field(default_factory=list)
    #: The trainer's signing keys in force (``stagesave.ondisk.signing.Keys``; ``None``: unsigned)
    signing: Any = None


@dataclass
class Reply:
    """The agent's answer to an order: its telemetry, and the error if it failed."""

    id: int
    telemetry: dict[str, Any]
    error: tuple[str, str] | None = None  # (class name in stagesave.errors, message)
    committed: dict[str, Any] | None = None  # what a snapshot of it needs (files only)
