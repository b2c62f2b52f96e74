"""What a trainer and its writer agent say to each other, over the socket pair the agent was
started with (unnamed: no other process can connect to it).

Every message is a length-prefixed pickle. Only the agent's own trainer holds the other end, so
the agent unpickles what it reads; it never reads anything else. The trainer reads the agent's
replies as plain tuples of numbers and strings.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

from ..saving.files import ImageCrcs
from ..saving.image import FileImage, StorageSlot
from ..stores.base import Store

__all__ = ["Order", "OrderFile", "Reply", "detach", "recv", "send"]

_LEN = struct.Struct("<Q")


def send(sock: socket.socket, message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(data)) + data)


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


def detach(image: FileImage) -> FileImage:
    """``image`` without anything of the state or the planner: its slots are places in the file
    only, its pieces are already in the buffer (what a writer needs, and all it may hold)."""
    slots = [_detached_slot(s.key, s.offset, s.nbytes) for s in image.slots]
    return FileImage(
        size=image.size, pieces=(), slots=slots, serialization_id=image.serialization_id,
        id_offset=image.id_offset, tensors=list(image.tensors), kind=image.kind, zip=image.zip,
        crc_fields=list(image.crc_fields), blank=image.blank, gapless=image.gapless,
        counts=(image.tensor_bytes, image.nonempty_slots),
    )


@dataclass
class OrderFile:
    """One staged file of an order: its image, where it sits in the segment, its CRCs."""

    name: str
    image: FileImage
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


@dataclass
class Reply:
    """The agent's answer to an order: its telemetry, and the error if it failed."""

    id: int
    telemetry: dict[str, Any]
    error: tuple[str, str] | None = None  # (class name in stagesave.errors, message)
    committed: dict[str, Any] | None = None  # what a snapshot of it needs (files only)
