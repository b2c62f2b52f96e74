"""``.metadata``'s pickle, made again only when the checkpoint's structure changed.

DCP builds a new :class:`~torch.distributed.checkpoint.metadata.Metadata` for every save, and
pickling it costs ~15-25 µs per item (the dataclasses, sizes and dtypes of every tensor: 0.1-0.2 s
for 8,000 items) on the coordinator's ``finish()``, inside ``dcp.save``. Between two saves of an
unchanged state only its ``storage_meta`` differs (the folder and the save's id). So the pickle
is cut where those two strings go and kept with the values it was made from: a save whose
metadata is equal to them, field by field (~1 µs per item), gets the kept pickle with its own two
strings put in (the last few structures' pickles are kept: Accelerate saves each model and
optimizer through one writer).

Its storage data (each item's file and offset, by index: ~0.4 µs per item to hash its index) is
made again only when some rank returned other write results than last time
(:class:`StorageData`).

The pickle is protocol 3: no frames, and every string is ``BINUNICODE`` (a fixed-size header),
so a string can be replaced by one of another length without touching anything around it (its
memo slot stays where it was). What a reader unpickles is a ``Metadata`` equal to the one
given; the bytes are those of ``pickle.dumps(metadata, protocol=3)`` except where two equal
values of the kept metadata shared one object and the new ones do not (or the reverse).
"""

from __future__ import annotations

import dataclasses
import pickle
import secrets
import struct
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ._recent import Recent

__all__ = ["PROTOCOL", "MetadataPickler"]

#: No frames, fixed-size string headers (see the module's docstring).
PROTOCOL = 3

_SPLICED = ("checkpoint_id", "save_id")  # the fields of ``storage_meta`` that change per save


def _string(s: str) -> bytes:
    """``s`` as protocol 3 pickles it (its memo opcode follows separately)."""
    data = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


def _fixed(metadata: Metadata) -> list[Any] | None:
    """What must be equal for the kept pickle to serve: every field but the two spliced
    strings; ``None`` when those are not plain strings."""
    meta = metadata.storage_meta
    if type(meta) is not StorageMeta:
        return None
    if type(meta.checkpoint_id) is not str or type(meta.save_id) is not str:
        return None
    return [
        *(getattr(metadata, f.name) for f in dataclasses.fields(metadata)
          if f.name != "storage_meta"),
        *(getattr(meta, f.name) for f in dataclasses.fields(meta) if f.name not in _SPLICED),
    ]


class MetadataPickler:
    """Pickles a writer's successive ``Metadata`` objects (one coordinator's, one thread),
    keeping the pickles of its last few structures (:mod:`._recent`)."""

    def __init__(self) -> None:
        self._known: Recent[tuple[list[Any], tuple[bytes, bytes, bytes]]] = Recent()
        self.reused = 0  # how many pickles were spliced (for tests and telemetry)

    def dumps(self, metadata: Metadata) -> bytes:
        fixed = _fixed(metadata)
        if fixed is None:
            return pickle.dumps(metadata, protocol=PROTOCOL)
        meta = metadata.storage_meta
        assert meta is not None
        known = self._known.find(lambda e: e[0] == fixed)
        if known is not None:
            parts = known[1]
            self.reused += 1
            # equal by value: keep this save's objects, which the next save's metadata shares
            # (its write results' indexes, the kept plan's dicts), so that comparing them
            # finds the same objects at once (a first kept from DCP's unpickled copies would
            # compare each item's index, ~1 µs each, at every save)
            known[0][:] = fixed
        else:
            cut = self._cut(metadata, meta)
            if cut is None:
                return pickle.dumps(metadata, protocol=PROTOCOL)
            parts = cut
            self._known.add((fixed, parts))
        head, middle, tail = parts
        assert isinstance(meta.checkpoint_id, str) and isinstance(meta.save_id, str)
        return b"".join(
            (head, _string(meta.checkpoint_id), middle, _string(meta.save_id), tail)
        )

    @staticmethod
    def _cut(metadata: Metadata, meta: StorageMeta) -> tuple[bytes, bytes, bytes] | None:
        """The pickle of ``metadata`` around its two strings (``None``: they were not found
        once each, in order)."""
        token = secrets.token_hex(8)
        marks = [f"\x00stagesave-{name}-{token}" for name in _SPLICED]
        marked_meta = dataclasses.replace(meta, checkpoint_id=marks[0], save_id=marks[1])
        marked = dataclasses.replace(metadata, storage_meta=marked_meta)
        raw = pickle.dumps(marked, protocol=PROTOCOL)
        first, second = (_string(m) for m in marks)
        if raw.count(first) != 1 or raw.count(second) != 1:
            return None
        a = raw.index(first)
        b = raw.index(second)
        if b < a:
            return None
        return raw[:a], raw[a + len(first) : b], raw[b + len(second) :]


class StorageData:
    """``.metadata``'s storage data (each write result's storage info, by index), made again
    only when some rank returned other result lists than the last save (a reused rank-file
    layout returns the very same list: compared by identity)."""

    def __init__(self) -> None:
        self._last: tuple[list[list[Any]], dict[Any, Any]] | None = None

    def of(self, results: list[list[Any]]) -> dict[Any, Any]:
        """The storage data of ``results`` (per rank, DCP's ``WriteResult`` s); a new dict."""
        last = self._last
        if last is not None and len(last[0]) == len(results) and all(
                a is b for a, b in zip(last[0], results)):
            return dict(last[1])
        made = {wr.index: wr.storage_data for rank in results for wr in rank}
        self._last = (list(results), made)
        return dict(made)
