"""A load's check of a large tensor index, done while the load's reads are in flight.

A format-2 torch file's tensor index (one entry per tensor: name, dtype, shape, stride) is
pinned by a digest in its proof, which :func:`.proof.read_proof` checks before anything is
loaded. Parsing and validating the entries themselves takes ~2.5 µs per tensor in Python
(:func:`.parse_index`; compiled, ~0.7 µs: :mod:`stagesave.ondisk.index_check_fast`), and a load
does not use them; yet a file whose index does not validate is corrupt, and a load must refuse it as
``verify`` does. So a load parses a large index (``manifest.pending_index``) on its own thread
while the I/O threads read and hash the file's chunks (``meanwhile`` of
:func:`.proof.chunk_problems`), or else before it returns, and raises before it hands out
anything if the index is invalid.
"""

from __future__ import annotations

from ..errors import IntegrityError, ManifestError
from ..ondisk.index_check_fast import check_index
from ..ondisk.manifest import Manifest

__all__ = ["IndexCheck"]


class IndexCheck:
    """The check of ``manifest``'s pending index (nothing to do if it has none)."""

    def __init__(self, manifest: Manifest | None, where: str) -> None:
        self.where = where
        self.problem: str | None = None
        self.raw = manifest.pending_index if manifest is not None else None

    def parse(self) -> None:
        """Parse and validate the index, once (a problem is kept for :meth:`raise_if_invalid`)."""
        raw, self.raw = self.raw, None
        if raw is None:
            return
        try:
            check_index(raw, self.where)
        except ManifestError as exc:
            self.problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure to read it makes the file corrupt
            self.problem = f"{self.where}: its tensor index cannot be read ({exc!r})"

    def raise_if_invalid(self) -> None:
        """Parse the index if that was not done yet.

        Raises:
            IntegrityError: the index does not validate (the words ``verify`` reports).
        """
        self.parse()
        if self.problem is not None:
            raise IntegrityError(f"checkpoint {self.where} is corrupt: {self.problem}")
