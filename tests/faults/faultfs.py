"""A recording filesystem for fault injection, in the spirit of LevelDB's fault-injection env.

:class:`Recorder` wraps every function of ``stagesave.stores.posix`` (the module through which the
local store makes each mutating POSIX call) around the real call: it logs what each call did,
can make a chosen call fail (ENOSPC, EIO) before it reaches the kernel, and can pause a call
(to act while a save is in flight). Nothing is mocked: the save really runs on a real directory.

:class:`PowerLossModel` replays that log on a model of the directory tree and materializes, into
a fresh real directory, what a power loss right after any one logged operation would leave:

- a file's bytes (and size, and mtime) survive only as of its last ``fsync``; this holds for
  O_DIRECT writes too (they bypass the page cache, not the drive's volatile cache or the
  filesystem's metadata for the new size);
- a directory entry (create, rename, unlink, mkdir, rmdir) survives only once the directory
  that holds it was fsynced; a renamed file keeps its inode's durable content, whatever its name.

Three views of the unsynced metadata are offered: ``durable`` drops all of it (the LevelDB
model), ``eager`` keeps all of it (the worst case for data: names may point at unsynced
content, the classic zero-length-file-after-rename bug) and ``random`` keeps a random subset of
the unsynced directory operations and of the unsynced writes (no ordering guarantee at all).
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Self

from stagesave.stores import posix as _fsops

__all__ = ["FSOPS", "MODES", "Call", "Op", "PowerLossModel", "Recorder"]

#: Functions of ``stagesave.stores.posix`` made of others of it (their parts are recorded, not
# them).
COMPOSITE = ("fsync_dir",)
#: Every other function of ``stagesave.stores.posix`` (all of them are wrapped).
FSOPS = tuple(n for n in _fsops.__all__ if n not in COMPOSITE)
#: Views of a power loss, see the module docstring.
MODES = ("durable", "eager", "random")


@dataclass(frozen=True)
class Op:
    """One logged operation that changed the tree (or made part of it durable).

    ``kind`` is one of open, pwrite, ftruncate, fallocate, fadvise, fsync, close, rename,
    exchange, link, symlink, unlink, mkdir, rmdir. ``write`` calls are logged as ``pwrite`` at the
    file position; ``dst`` is the second path of rename, exchange and link; a symlink's target
    is its ``data``.
    """

    kind: str
    path: str
    fd: int = -1
    offset: int = 0
    length: int = 0
    data: bytes = b""
    dst: str = ""
    created: bool = False
    is_dir: bool = False
    t_ns: int = 0


@dataclass(frozen=True)
class Call:
    """A call about to be made, as hooks see it (fd-based calls carry the fd's path)."""

    name: str
    args: tuple[Any, ...]
    path: str
    is_dir: bool
    index: int  # how many calls of this name came before (0 for the first)


class Recorder:
    """Wraps ``stagesave.stores.posix`` while active (``with recorder:``), logging every effect.

    Args:
        base: The directory tree the model covers; every path touched must lie inside it.
    """

    def __init__(self, base: str | os.PathLike[str]) -> None:
        self.base = os.path.abspath(os.fspath(base))
        self.ops: list[Op] = []
        self.recording = True
        self._real = {name: getattr(_fsops, name) for name in FSOPS}
        self._fds: dict[int, tuple[str, bool]] = {}
        self._pos: dict[int, int] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.RLock()
        self._hooks: list[Callable[[Call], None]] = []

    # ------------------------------------------------------------------ installing
    def __enter__(self) -> Self:
        for name in FSOPS:
            setattr(_fsops, name, self._wrapper(name))
        return self

    def __exit__(self, *exc: object) -> None:
        for name in FSOPS:
            setattr(_fsops, name, self._real[name])

    def add_hook(self, hook: Callable[[Call], None]) -> None:
        """Run ``hook`` before every call; it may raise (the call then never happens) or block."""
        self._hooks.append(hook)

    def fail(self, name: str, err: int, *, nth: int = 1,
             when: Callable[[Call], bool] | None = None, every: bool = False) -> list[Call]:
        """Make the ``nth`` call of ``name`` matching ``when`` (or, with ``every``, each one from
        the ``nth`` on) raise ``OSError(err)``.

        Returns:
            A list that receives each call the fault fired at.
        """
        fired: list[Call] = []
        seen = [0]

        def hook(call: Call) -> None:
            if call.name != name or (when is not None and not when(call)):
                return
            seen[0] += 1
            if seen[0] == nth or (every and seen[0] > nth):
                fired.append(call)
                raise OSError(err, f"{os.strerror(err)} (injected)")

        self.add_hook(hook)
        return fired

    # ------------------------------------------------------------------ the wrapper
    def _wrapper(self, name: str) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, args, kwargs)

        wrapped.__name__ = name
        return wrapped

    def _describe(self, name: str, args: tuple[Any, ...]) -> Call:
        with self._lock:
            index = self._counts.get(name, 0)
            self._counts[name] = index + 1
            if name in ("close", "pwrite", "write", "fsync", "ftruncate", "posix_fallocate",
                        "posix_fadvise"):
                path, is_dir = self._fds.get(args[0], ("", False))
            else:
                path = os.path.abspath(args[1] if name == "symlink" else args[0])
                is_dir = os.path.isdir(path)
        return Call(name, args, path, is_dir, index)

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = self._describe(name, args)
        for hook in list(self._hooks):
            hook(call)
        pre = self._before(name, call)
        result = self._real[name](*args, **kwargs)
        if self.recording:
            self._record(name, call, pre, result, kwargs)
        elif name == "open":
            self._fds[result] = (call.path, os.path.isdir(call.path))
        elif name == "close":
            self._fds.pop(args[0], None)
        return result

    def _before(self, name: str, call: Call) -> Any:
        """What must be looked at before the real call changes it."""
        if name == "open":
            return os.path.lexists(call.path)
        if name == "makedirs":
            missing = []
            p = call.path
            while not os.path.lexists(p):
                missing.append(p)
                p = os.path.dirname(p)
            return list(reversed(missing))
        if name == "rmtree":
            if not os.path.isdir(call.path) or os.path.islink(call.path):
                return []
            doomed: list[tuple[str, str]] = []
            for dirpath, dirnames, filenames in os.walk(call.path, topdown=False):
                for n in filenames:
                    doomed.append(("unlink", os.path.join(dirpath, n)))
                for n in dirnames:
                    p = os.path.join(dirpath, n)
                    doomed.append(("unlink" if os.path.islink(p) else "rmdir", p))
            doomed.append(("rmdir", call.path))
            return doomed
        return None

    def _record(self, name: str, call: Call, pre: Any, result: Any, kwargs: dict[str, Any]) -> None:
        t = time.time_ns()
        args = call.args
        with self._lock:
            if name == "open":
                flags = args[1]
                is_dir = os.path.isdir(call.path)
                created = bool(flags & os.O_CREAT) and not pre
                self._fds[result] = (call.path, is_dir)
                self._pos[result] = 0
                self._log(Op("open", call.path, fd=result, created=created, is_dir=is_dir, t_ns=t))
            elif name == "close":
                self._log(Op("close", call.path, fd=args[0], t_ns=t))
                self._fds.pop(args[0], None)
                self._pos.pop(args[0], None)
            elif name in ("pwrite", "write"):
                fd, data = args[0], args[1]
                if name == "pwrite":
                    offset = args[2]
                else:
                    offset = self._pos.get(fd, 0)
                    self._pos[fd] = offset + result
                raw = bytes(memoryview(data).cast("B")[:result])
                self._log(
                    Op("pwrite", call.path, fd=fd, offset=offset, length=result, data=raw, t_ns=t)
                )
            elif name == "fsync":
                self._log(Op("fsync", call.path, fd=args[0], is_dir=call.is_dir, t_ns=t))
            elif name == "ftruncate":
                self._log(Op("ftruncate", call.path, fd=args[0], length=args[1], t_ns=t))
            elif name == "posix_fallocate":
                self._log(
                    Op("fallocate", call.path, fd=args[0], offset=args[1], length=args[2], t_ns=t)
                )
            elif name == "posix_fadvise":
                self._log(Op("fadvise", call.path, fd=args[0], t_ns=t))
            elif name in ("replace", "rename"):
                self._log(Op("rename", call.path, dst=os.path.abspath(args[1]), t_ns=t))
            elif name in ("exchange", "link"):
                self._log(Op(name, call.path, dst=os.path.abspath(args[1]), t_ns=t))
            elif name == "mkdir":
                self._log(Op("mkdir", call.path, t_ns=t))
            elif name in ("unlink", "rmdir"):
                self._log(Op(name, call.path, t_ns=t))
            elif name == "symlink":  # symlink(target, path): the path is the second argument
                self._log(
                    Op("symlink", os.path.abspath(args[1]), data=os.fsencode(args[0]), t_ns=t)
                )
            elif name == "makedirs":
                for p in pre:
                    self._log(Op("mkdir", p, t_ns=t))
            elif name == "rmtree":
                for kind, p in pre:
                    if not os.path.lexists(p):
                        self._log(Op(kind, p, t_ns=t))
            else:  # pragma: no cover - a new _fsops function must be modelled here
                raise AssertionError(f"faultfs does not model _fsops.{name}")

    def _log(self, op: Op) -> None:
        for p in (op.path, op.dst):
            if p and os.path.commonpath([p, self.base]) != self.base:
                raise AssertionError(f"{op.kind} of {p} lies outside the modelled tree {self.base}")
        self.ops.append(op)


# ---------------------------------------------------------------------------- the model
@dataclass
class _File:
    durable: bytes
    durable_mtime: int
    pending: list[tuple[Any, ...]] = field(default_factory=list)

    def content(self, keep: Callable[[], bool] | None = None) -> tuple[bytes, int]:
        """Bytes and mtime with all (or the ``keep``-chosen) unsynced changes applied."""
        data = bytearray(self.durable)
        mtime = self.durable_mtime
        for change in self.pending:
            if keep is not None and not keep():
                continue
            kind, t = change[0], change[-1]
            if kind == "write":
                _, off, raw, _ = change
                if len(data) < off:
                    data.extend(bytes(off - len(data)))
                data[off : off + len(raw)] = raw
            elif kind == "truncate":
                n = change[1]
                del data[n:]
                data.extend(bytes(n - len(data)))
            elif kind == "extend":
                _, off, n, _ = change
                if len(data) < off + n:
                    data.extend(bytes(off + n - len(data)))
            mtime = t
        return bytes(data), mtime


@dataclass
class _Link:
    """A symbolic link (its target never changes: a new link is a new node)."""

    target: bytes


@dataclass
class _Dir:
    durable: dict[str, int]
    current: dict[str, int]
    pending: list[tuple[Any, ...]] = field(default_factory=list)


def _apply_entry(entries: dict[str, int], change: tuple[Any, ...]) -> None:
    kind = change[0]
    if kind == "link":
        entries[change[1]] = change[2]
    elif kind == "unlink":
        entries.pop(change[1], None)
    elif kind == "rename":
        _, src, dst, ino = change
        if entries.get(src) == ino:  # a subset may have dropped the creation of the source
            del entries[src]
            entries[dst] = ino
    elif kind == "exchange":
        _, a, b, ino_a, ino_b = change
        if entries.get(a) == ino_a and entries.get(b) == ino_b:
            entries[a], entries[b] = ino_b, ino_a


class PowerLossModel:
    """Replays a :class:`Recorder` log over a snapshot of the tree taken before it started.

    Args:
        base: The modelled tree; its state at construction counts as fully durable.
    """

    def __init__(self, base: str | os.PathLike[str]) -> None:
        self.base = os.path.abspath(os.fspath(base))
        self.nodes: dict[int, _File | _Dir | _Link] = {}
        self.fds: dict[int, int] = {}
        self.applied = 0
        self.root = self._snapshot(self.base)

    def _new(self, node: _File | _Dir | _Link) -> int:
        ino = len(self.nodes)
        self.nodes[ino] = node
        return ino

    def _snapshot(self, path: str) -> int:
        if os.path.isdir(path) and not os.path.islink(path):
            entries = {
                name: self._snapshot(os.path.join(path, name)) for name in sorted(os.listdir(path))
            }
            return self._new(_Dir(dict(entries), dict(entries)))
        if os.path.islink(path):
            return self._new(_Link(os.fsencode(os.readlink(path))))
        with open(path, "rb") as f:
            data = f.read()
        return self._new(_File(data, os.stat(path).st_mtime_ns))

    # ------------------------------------------------------------------ replay
    def _lookup(self, path: str) -> int:
        rel = os.path.relpath(path, self.base)
        ino = self.root
        if rel == ".":
            return ino
        for part in rel.split(os.sep):
            node = self.nodes[ino]
            assert isinstance(node, _Dir), f"{path}: a component is not a directory in the model"
            ino = node.current[part]
        return ino

    def _parent(self, path: str) -> tuple[_Dir, str]:
        node = self.nodes[self._lookup(os.path.dirname(path))]
        assert isinstance(node, _Dir)
        return node, os.path.basename(path)

    @staticmethod
    def _change(d: _Dir, change: tuple[Any, ...]) -> None:
        _apply_entry(d.current, change)
        d.pending.append(change)

    def apply(self, op: Op) -> None:
        """Advance the model by one logged operation."""
        k = op.kind
        if k == "open":
            if op.created:
                d, name = self._parent(op.path)
                self._change(d, ("link", name, self._new(_File(b"", op.t_ns))))
            self.fds[op.fd] = self._lookup(op.path)
        elif k == "close":
            self.fds.pop(op.fd, None)
        elif k in ("pwrite", "ftruncate", "fallocate"):
            node = self.nodes[self.fds[op.fd]]
            assert isinstance(node, _File)
            if k == "pwrite":
                node.pending.append(("write", op.offset, op.data, op.t_ns))
            elif k == "ftruncate":
                node.pending.append(("truncate", op.length, op.t_ns))
            else:
                node.pending.append(("extend", op.offset, op.length, op.t_ns))
        elif k == "fsync":
            node = self.nodes[self.fds[op.fd]]
            if isinstance(node, _Dir):
                node.durable = dict(node.current)
            else:
                node.durable, node.durable_mtime = node.content()
            node.pending = []
        elif k == "rename":
            sd, sname = self._parent(op.path)
            dd, dname = self._parent(op.dst)
            ino = sd.current[sname]
            if sd is dd:
                self._change(sd, ("rename", sname, dname, ino))
            else:
                self._change(sd, ("unlink", sname))
                self._change(dd, ("link", dname, ino))
        elif k == "exchange":
            ad, aname = self._parent(op.path)
            bd, bname = self._parent(op.dst)
            ino_a, ino_b = ad.current[aname], bd.current[bname]
            if ad is bd:
                self._change(ad, ("exchange", aname, bname, ino_a, ino_b))
            else:
                self._change(ad, ("link", aname, ino_b))
                self._change(bd, ("link", bname, ino_a))
        elif k == "link":  # a second name for the same inode
            sd, sname = self._parent(op.path)
            dd, dname = self._parent(op.dst)
            self._change(dd, ("link", dname, sd.current[sname]))
        elif k in ("unlink", "rmdir"):
            d, name = self._parent(op.path)
            self._change(d, ("unlink", name))
        elif k == "mkdir":
            d, name = self._parent(op.path)
            self._change(d, ("link", name, self._new(_Dir({}, {}))))
        elif k == "symlink":
            d, name = self._parent(op.path)
            self._change(d, ("link", name, self._new(_Link(op.data))))
        elif k != "fadvise":
            raise AssertionError(f"unknown op {k}")
        self.applied += 1

    # ------------------------------------------------------------------ power loss
    def materialize(
        self, dest: str | os.PathLike[str], mode: str, rng: random.Random | None = None
    ) -> None:
        """Write the tree a power loss now would leave (see the module docstring) into ``dest``."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        keep = (lambda: rng.random() < 0.5) if mode == "random" and rng is not None else None
        if mode == "random" and rng is None:
            raise ValueError("mode 'random' needs an rng")

        def entries(d: _Dir) -> dict[str, int]:
            if mode == "durable":
                return d.durable
            if mode == "eager":
                return d.current
            out = dict(d.durable)
            for change in d.pending:
                if keep is not None and keep():
                    _apply_entry(out, change)
            return out

        def build(ino: int, path: str, depth: int) -> None:
            assert depth < 64, "directory cycle in the model"
            node = self.nodes[ino]
            if isinstance(node, _Dir):
                os.makedirs(path, exist_ok=True)
                for name, child in sorted(entries(node).items()):
                    build(child, os.path.join(path, name), depth + 1)
                return
            if isinstance(node, _Link):
                os.symlink(os.fsdecode(node.target), path)
                return
            if mode == "random":
                data, mtime = node.content(keep)
            else:
                data, mtime = node.durable, node.durable_mtime
            with open(path, "wb") as f:
                f.write(data)
            os.utime(path, ns=(mtime, mtime))

        build(self.root, os.fspath(dest), 0)


def fsync_dir_after(ops: list[Op], start: int, directory: str) -> int:
    """Index of the first fsync of ``directory`` at or after ``start`` (-1 if none)."""
    for i in range(start, len(ops)):
        op = ops[i]
        if op.kind == "fsync" and op.is_dir and op.path == directory:
            return i
    return -1


def rename_to(ops: list[Op], start: int, end: int, dst: str) -> int:
    """Index of the rename onto ``dst`` (or exchange with it) in ``ops[start:end]`` (-1 if none)."""
    for i in range(start, end):
        op = ops[i]
        if (op.kind == "rename" and op.dst == dst) or (
            op.kind == "exchange" and dst in (op.path, op.dst)
        ):
            return i
    return -1
