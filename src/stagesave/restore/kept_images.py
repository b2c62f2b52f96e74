"""Images a verification read, kept for the load that follows it in the same scope.

A resume verifies a checkpoint before anything of it is loaded (a corrupt one must not be half
loaded), then loads it. Inside :func:`keeping`, verifying a local torch file that
:func:`.image_load.applies` to reads it into the memory its tensors will keep (parallel
``O_DIRECT`` reads, each chunk hashed as it lands) and keeps that image; the load that follows
(:func:`take`, by path) unpickles from it instead of reading the file a second time. A local
safetensors file is kept the same way (:func:`take_safetensors`,
:mod:`.safetensors_image`). The image is
handed out only while the file is the very inode that was verified, unchanged (the identity of
:mod:`.verified_memo`), at most once, and everything not taken is dropped when the scope ends:
a scope holds memory only between a verification and its load.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..ondisk.manifest import Manifest
from ..ondisk.names import ALIGNMENT
from ..stores.base import Reader
from .verified_memo import stat_identity

if TYPE_CHECKING:  # image_load imports torch, which a writer agent never does
    from .image_load import Image
    from .safetensors_image import SafetensorsImage

__all__ = ["keep_while_checking", "keeping", "take", "take_safetensors"]

_lock = threading.Lock()
#: Open scopes (nested or on several threads): path -> (file identity, image).
_scopes: list[dict[str, tuple[tuple[int, ...], Image | SafetensorsImage]]] = []


@contextlib.contextmanager
def keeping() -> Iterator[None]:
    """Within the block, verifications keep the images they read for :func:`take`."""
    scope: dict[str, tuple[tuple[int, ...], Image | SafetensorsImage]] = {}
    with _lock:
        _scopes.append(scope)
    try:
        yield
    finally:
        with _lock:
            _scopes.remove(scope)
        scope.clear()


def keep_while_checking(reader: Reader, manifest: Manifest,
                        pool: cf.Executor) -> list[str] | None:
    """Check every chunk of ``reader``'s file by reading it into an image kept for the load;
    the problems, or ``None`` when no scope is open or the file does not qualify (the caller
    checks it as usual)."""
    with _lock:
        scope = _scopes[-1] if _scopes else None
    fd = reader.fileno()
    if scope is None or fd is None:
        return None
    from . import image_load  # a scope is open only in a process that loads (torch imported)

    entry = manifest.files[0]
    image: Image | SafetensorsImage
    if entry.kind == "safetensors" and entry.chunk_bytes % ALIGNMENT == 0:
        from .safetensors_image import SafetensorsImage

        buf, problems = image_load.read_proven(reader, fd, manifest, pool, reader.where)
        image = SafetensorsImage(buf.view[: entry.end], reader.where)
    elif image_load.applies(entry):
        image, problems = image_load.read_image(reader, fd, manifest, pool, reader.where)
    else:
        return None
    if not problems:
        proc = f"/proc/self/fd/{fd}"
        path = os.path.realpath(proc if os.path.exists(proc) else reader.where)
        with _lock:
            scope[path] = (stat_identity(os.fstat(fd)), image)
    return problems


def take(path: str | os.PathLike[str]) -> Image | None:
    """The image kept for the torch file at ``path``, if it is still the inode that was
    verified, unchanged; given out once."""
    from .image_load import Image

    kept = _take(path)
    return kept if isinstance(kept, Image) else None


def take_safetensors(path: str | os.PathLike[str]) -> SafetensorsImage | None:
    """:func:`take` for a safetensors file."""
    from .safetensors_image import SafetensorsImage

    kept = _take(path)
    return kept if isinstance(kept, SafetensorsImage) else None


def _take(path: str | os.PathLike[str]) -> Image | SafetensorsImage | None:
    real = os.path.realpath(path)
    try:
        ident = stat_identity(os.stat(real))
    except OSError:
        return None
    with _lock:
        for scope in reversed(_scopes):
            kept = scope.pop(real, None)
            if kept is not None:
                return kept[1] if kept[0] == ident else None
    return None
