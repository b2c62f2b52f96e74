"""The Checkpointer: ``save`` returns after one copy into host memory; the rest is background.

A facade: each method is a few lines over the save path (:mod:`stagesave.saving`: plan,
staging, the pipeline's jobs) and the read path (:mod:`stagesave.restore`). See
``docs/architecture.md`` for the tree and the path of a save through it.
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .agent.route import Writer
from .handle import SaveHandle
from .ondisk.checksum import CRYPTOGRAPHIC, DEFAULT_ALGORITHM, check_algorithm
from .ondisk.names import DEFAULT_CHUNK_BYTES
from .ondisk.signing import current as signing_keys
from .restore.discovery import CheckpointInfo, scan
from .restore.load import load_checkpoint
from .restore.select import latest_in, resume_choice
from .restore.verify import verify_checkpoint
from .saving import behind, jobs, lifecycle, plan, validate
from .saving.behind import Held, Holder
from .saving.held_job import Holding, held_job
from .saving.memory import StagingMemory
from .saving.pipeline import Pipeline
from .saving.plan_folder import plan_folder
from .saving.staging import Stager
from .saving.steady import PlanCache
from .stores.base import Store
from .stores.targets import StoreResolver
from .telemetry import SaveTelemetry, SinkOption, TelemetryCallback, TelemetrySink

__all__ = ["Checkpointer", "flush_all", "flush_on_sigterm"]

flush_all, flush_on_sigterm = lifecycle.flush_all, lifecycle.flush_on_sigterm


class Checkpointer:
    """Asynchronous, verifiable checkpoints of any torch state.

    Args (``docs/user-guide.md``, "Options", says more about each):
        root: Default directory (path, fsspec URL or :class:`Store`) for relative paths.
        max_pending: Saves in flight (one staging buffer each); a further save waits for one.
        checksum: ``"crc32"`` (default), ``"xxh3_128"``, ``"xxh3_64"``, ``"blake3"``, ``"sha256"``.
        keep_last: After each commit keep this many committed checkpoints there (``None``: all).
        io_threads: Threads writing chunks of one file in parallel.
        chunk_bytes: Size of a checksum chunk and of one write.
        direct_io: Write local files with O_DIRECT where the filesystem allows it.
        storage_options: Passed to fsspec for URLs (endpoint, credentials, region).
        telemetry_callback: Called with each save's :class:`SaveTelemetry`.
        telemetry_jsonl: ``True``: append telemetry beside local checkpoints; or a file path.
        safe_globals: Extra classes allowed when loading (see :mod:`stagesave.safety`).
        pinned: Pin staging buffers (default: when CUDA is available).
        checksum_in: ``"staging"``, ``"background"`` or ``"auto"``: who hashes the chunks.
        device_staging: Stage a CUDA device's state in a reused buffer on that device.
        writer: ``"process"`` (default; a writer agent outliving this process) or ``"thread"``.
        plan_behind: Plan a new structure of many small tensors on the writer thread (the
            caller copies its storages): default with ``writer="thread"``.
    """

    telemetry_callback = SinkOption()
    telemetry_jsonl = SinkOption()

    def __init__(
        self, root: Store | str | os.PathLike[str] | None = None, *, max_pending: int = 2,
        checksum: str = DEFAULT_ALGORITHM, keep_last: int | None = None, io_threads: int = 4,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES, direct_io: bool = True,
        storage_options: dict[str, Any] | None = None,
        telemetry_callback: TelemetryCallback | None = None, telemetry_jsonl: bool | str = False,
        safe_globals: Iterable[Any] = (), pinned: bool | None = None, checksum_in: str = "auto",
        device_staging: bool = False, writer: str | None = None, plan_behind: bool | None = None,
    ) -> None:
        validate.check_options(keep_last=keep_last, io_threads=io_threads, chunk_bytes=chunk_bytes)
        if plan_behind is not None and not isinstance(plan_behind, bool):
            raise TypeError(f"plan_behind must be True, False or None, got {plan_behind!r}")
        self._checksum = check_algorithm(checksum)
        signing_keys()  # a bad key or key file in the environment: a clear error now
        self.keep_last, self.io_threads, self.chunk_bytes = keep_last, io_threads, chunk_bytes
        self.safe_globals = list(safe_globals)
        self.checksum_in, self.device_staging = checksum_in, device_staging
        # The parts, public inside the package (stagesave.dcp runs on them too).
        self.writer = Writer(writer, io_threads, device_staging)
        self.memory = StagingMemory(max_pending, pinned, segments=self.writer.agent)
        self.stager = Stager(self.memory, checksum_in=checksum_in, chunk_bytes=chunk_bytes,
                             device_staging=device_staging)
        self.plans = PlanCache(None if device_staging else self.memory.prepare)  # the last plan
        #: first saves of many small tensors planned on the writer thread (``saving/behind.py``)
        self.plan_behind = self.writer.mode == "thread" if plan_behind is None else plan_behind
        self.telemetry_sink = sink = TelemetrySink(telemetry_callback, telemetry_jsonl)
        self.pipeline = Pipeline(io_threads, sink.emit)
        self.targets = StoreResolver(root, storage_options=storage_options, direct_io=direct_io)
        sink.attach(self.targets.root)  # a tiered root's remote commits report there too
        lifecycle.register(self, (self.pipeline, self.stager, self.memory, self.writer))

    @property
    def checksum(self) -> str:
        """The chunk checksum of the next save: the one chosen, or ``"blake3"`` while a signing
        key is in force and the one chosen is not cryptographic."""
        signed = self._checksum not in CRYPTOGRAPHIC and signing_keys() is not None
        return "blake3" if signed else self._checksum

    # ------------------------------------------------------------------ saving
    @plan.collector_paused
    def save(self, state: Any, path: str | os.PathLike[str], *,
             metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Stage ``state`` and write it to ``path`` in the background.

        Returns after the state has been copied into host memory (changing ``state`` afterwards
        does not change the checkpoint). The file is a ``torch.save`` file carrying its proof.

        Raises:
            CheckpointError: an earlier background save failed (raised once, here or elsewhere);
                the target cannot be written; the state holds an unsupported object; closed.
        """
        self.pipeline.check_usable()
        t_start = time.perf_counter()
        store, name = validate.target(self.targets, path)
        tel = SaveTelemetry(path=store.describe(name), started_at=time.time())
        tel.tier = "local" if hasattr(store, "attach_telemetry") else None
        meta = validate.checked_metadata(metadata)
        image = self.plans.plan_or_hold(state, self._holder() if self.plan_behind else None)
        tel.plan_s = time.perf_counter() - t_start
        if isinstance(image, Held):
            handle = self._save_held(image, store, name, tel, meta, t_start)
            if handle is not None:
                return handle
            image = self.plans.plan(state)  # no room for its copy and a buffer: planned here
        else:
            self._check_proof([(len(image.slots), image.size)], meta)
        store.check_writable(name, image.size)
        staged = self.stager.stage([(name, image)], store, tel, algorithm=self.checksum,
                                   folder=False)
        try:
            job = self.writer.route(jobs.file_job(SaveHandle(tel.path, tel), store, name, staged,
                                                  settings=self, meta=meta, t_start=t_start),
                                    self)
        except BaseException:  # a Ctrl-C handing it over: nothing will write this buffer
            staged.give_back()
            raise
        tel.blocking_s = time.perf_counter() - t_start
        return self.pipeline.submit(job)

    def _check_proof(self, files: list[tuple[int, int]], meta: dict[str, Any]) -> None:
        validate.check_proof_fits(files, chunk_bytes=self.chunk_bytes, algorithm=self.checksum,
                                  metadata=meta)

    def _holder(self) -> Holder:
        """What holds a save to be planned behind (``saving/behind.py``)."""
        return lambda walked: behind.hold(walked, self.stager.copy_threads, self.stager.workers)

    def _save_held(self, held: Held, store: Store, name: str, tel: SaveTelemetry,
                   meta: dict[str, Any], t_start: float) -> SaveHandle | None:
        """Lease the held save's buffer now (buffers go to jobs in the order they are queued),
        queue its job (:mod:`.saving.held_job`); ``None``: no memory for that buffer beside the
        held copy (the copy let go: the save is planned on the caller's time)."""
        holding = None
        try:
            self._check_proof([(len(held.spans), held.bounds[1])], meta)
            store.check_writable(name, held.nbytes)
            try:
                holding = Holding(held, self.memory.lease(held.bounds[1]))
            except (OSError, MemoryError):
                held.release()
                return None
            tel.buffer_wait_s = holding.lease.waited_s
            job = held_job(SaveHandle(tel.path, tel), store, name, holding, checkpointer=self,
                           meta=meta, t_start=t_start)
            tel.blocking_s = time.perf_counter() - t_start
        except BaseException:  # (a Ctrl-C too: nothing will run the job)
            held.release()
            if holding is not None:
                holding.give_back()
            raise
        return self.pipeline.submit(job)  # (refused: it gives back what the job holds)

    def prepare_buffer(self, nbytes: int) -> None:
        """Make the staging buffer of a coming save of about ``nbytes`` (its file's size: e.g.
        the size of the checkpoint a run resumes from) now, on a thread: its memory reserved and
        its pages mapped before that save, whose copy then maps nothing (the first save of a
        0.4–2 GiB state took 4–6× longer without it on this project's VM, BENCHMARKS.md). A
        smaller free buffer is made again at that size. Nothing when a free buffer is that large
        already, when every buffer is in use, or with ``device_staging``; a failure to allocate
        is not raised here (the save allocates again and reports it).

        Raises:
            TypeError: ``nbytes`` is not an int.
            ValueError: ``nbytes`` is negative.
            ClosedError: closed.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"nbytes must be an int (bytes), got {nbytes!r}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self.pipeline.check_open()
        if nbytes and self.plans.prepare is not None:  # device staging: no host buffer
            self.plans.prepare(lambda: (nbytes, nbytes))

    @plan.collector_paused
    def save_dir(self, files: dict[str, Any], directory: str | os.PathLike[str], *,
                 metadata: dict[str, Any] | None = None,
                 staging_dir: str | os.PathLike[str] | None = None,
                 nested: Sequence[str] = ()) -> SaveHandle:
        """Stage several files and commit them together as one folder checkpoint.

        ``files`` maps names inside ``directory`` to a torch state, :class:`~.formats.Safetensors`
        or :class:`~.formats.Raw` bytes; the checkpoint is these files, appears once all is
        durable, replaces an existing one atomically (files of the user's in the folder are
        kept: the checkpoint is then published into it, see :mod:`.saving.beside`).
        ``staging_dir``: where a local folder is assembled (same filesystem). ``nested``:
        sub-folder checkpoints the caller moves in after this commit (an FSDP checkpoint's DCP
        parts), named by the folder's proof.

        Raises:
            ValueError: no files, an invalid file name, or only raw files (nothing can carry
                the folder's proof).
            Like :meth:`save` otherwise.
        """
        self.pipeline.check_usable()
        t_start = time.perf_counter()
        validate.check_folder_names(files)
        store, dname = validate.target(self.targets, directory)
        tel = SaveTelemetry(path=store.describe(dname), started_at=time.time())
        meta = validate.checked_metadata(metadata)
        planned = plan_folder(files, meta, algorithm=self.checksum, chunk_bytes=self.chunk_bytes,
                              plans=self.plans)
        tel.plan_s = time.perf_counter() - t_start
        self._check_proof([(len(image.slots), image.size) for _, image in planned], meta)
        validate.check_folder_writable(store, dname, [image for _, image in planned])
        where = validate.check_same_filesystem(store, dname, staging_dir)
        staged = self.stager.stage(planned, store, tel, algorithm=self.checksum, folder=True)
        try:
            job = self.writer.route(jobs.folder_job(
                SaveHandle(tel.path, tel), store, dname, staged, settings=self, meta=meta,
                t_start=t_start, staging_dir=where, nested=list(nested)), self)
        except BaseException:  # a Ctrl-C handing it over: nothing will write this buffer
            staged.give_back()
            raise
        tel.blocking_s = time.perf_counter() - t_start
        return self.pipeline.submit(job)

    def remove(self, path: str | os.PathLike[str]) -> SaveHandle:
        """Delete a checkpoint after every save submitted before this call (by any Checkpointer
        of this process, for that path). Returns a handle; ``result()`` waits for the removal.
        """
        self.pipeline.check_open()
        store, name = self.targets.split(path)
        tel = SaveTelemetry(path=store.describe(name), started_at=time.time())
        handle = SaveHandle(tel.path, tel, kind="remove")
        return self.pipeline.submit(jobs.remove_job(handle, store, name))

    def run_after(self, fn: Callable[[], None], *, description: str = "action") -> SaveHandle:
        """Run ``fn`` on the writer thread after every save and removal submitted before it
        (small ordered steps: no torch operations or collectives). Its exception is delivered
        like a failed save's."""
        self.pipeline.check_open()
        tel = SaveTelemetry(path=description, started_at=time.time())
        handle = SaveHandle(description, tel, kind="action")
        return self.pipeline.submit(jobs.action_job(handle, fn, description), track=False)

    # ------------------------------------------------------------------ waiting
    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted save and removal has finished (called by an action of
        this Checkpointer, it does not wait: what was queued before the action has finished).
        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: a background save failed and its error was not delivered yet.
        """
        self.pipeline.wait(timeout)

    def pending(self) -> int:  # saves and removals not finished yet
        return self.pipeline.pending()

    def wait_quietly(self) -> None:
        """Wait for pending work without raising (errors stay queued for the next call)."""
        self.pipeline.drain()

    # ------------------------------------------------------------------ reading
    def load(self, path: str | os.PathLike[str], map_location: Any = None, *, verify: bool = True,
             mmap: bool | None = None, trusted: bool = False,
             safe_globals: Iterable[Any] = ()) -> Any:
        """Load a checkpoint written by stagesave or by ``torch.save``.

        Waits for pending saves of the same path. The file is opened once: its proof and its
        bytes come from that one version, even if the name is replaced meanwhile. With
        ``verify`` (default) every byte is checked against the proof before anything is
        unpickled. A stagesave torch file is read once into memory its tensors keep; other
        local files load with ``mmap`` (copy-on-write pages of the verified file). A
        safetensors file loads as ``safetensors.torch.load_file`` reads it (a dict of tensors),
        checked against its proof where it has one.

        Raises:
            CheckpointNotFoundError: no such file.
            IntegrityError: the file does not match its proof.
            UnsafeCheckpointError: the file needs a class that is not allow-listed.
        """
        store, name = self.targets.split(path)
        return load_checkpoint(store, name, self.pipeline.io_pool, chunk_bytes=self.chunk_bytes,
                               map_location=map_location, verify=verify, mmap=mmap,
                               trusted=trusted, safe_globals=[*self.safe_globals, *safe_globals])

    def verify(self, path: str | os.PathLike[str]) -> CheckpointInfo:
        """Check a checkpoint (file or folder) against its proof, reading every byte: its
        ``status`` is ``"verified"``, ``"corrupt"`` (see ``problems``) or ``"unverified"``.

        Raises:
            CheckpointNotFoundError: no such file.
        """
        store, name = self.targets.split(path)
        return verify_checkpoint(store, name, self.pipeline.io_pool)

    def list(self, root: str | os.PathLike[str] | None = None) -> list[CheckpointInfo]:
        """Checkpoints directly in ``root``, newest first (committed, unverified and corrupt;
        format-2 files from their summaries: ``manifest`` is ``None`` until verified)."""
        store = self.targets.dir_store(root)
        self.pipeline.settle(store)
        return scan(store, settle=True)

    def latest(self, root: str | os.PathLike[str] | None = None, *,
               verify: bool = True) -> CheckpointInfo | None:
        """The newest checkpoint in ``root`` that a resume can load (``None`` if there is none).

        Candidates are tried newest first; one that fails is skipped with a warning naming it
        and what is wrong. With ``verify`` (default) every byte of the one returned matched its
        proof (a plain ``torch.save`` file must be a zip whose records match their CRC-32s, or
        a legacy file that parses), and the :meth:`load` that follows does not hash it again.
        ``verify=False`` checks proofs but not the bytes they prove (the cheap choice for
        listings; its choice can still fail at ``load()``). Reading never writes: a folder left
        aside by a crash is offered where it lies. A checkpoint another process replaces while
        it is checked is checked again, never reported as damaged (``docs/user-guide.md``).

        Raises:
            CheckpointError: the directory cannot be listed.
        """
        store = self.targets.dir_store(root)
        return latest_in(store, verify, self.pipeline.io_pool, self.pipeline.settle)

    def resume_from(self, path: str | os.PathLike[str], *, verify: bool = True) -> str | None:
        """What a resume pointed at ``path`` as *the newest checkpoint* should load.

        For callers that resolved "the newest" themselves (Lightning's ``ckpt_path="last"``):
        ``path`` if a resume can load it (checked as :meth:`latest` checks a candidate);
        otherwise, after a warning naming it and what is wrong, the newest checkpoint beside it
        that a resume can load; ``None`` if there is none.

        Raises:
            CheckpointError: the directory cannot be listed.
        """
        store, name = self.targets.split(path)
        got = resume_choice(store, name, verify, self.pipeline.io_pool, self.pipeline.settle,
                            self.targets.dir_store)
        return os.fspath(path) if got is True else (got.path if got else None)

    # ------------------------------------------------------------------ lifecycle
    def close(self, timeout: float | None = None) -> None:
        """Finish pending saves, release buffers and threads; raise an undelivered failure
        (safe to call more than once)."""
        if self.pipeline.mark_closed():
            try:
                self.pipeline.stop(timeout)
            finally:
                self.plans.forget()
                lifecycle.release_closed(self, (self.writer, self.stager, self.memory,
                                                self.targets), timeout)
        self.pipeline.raise_failures()

    def __enter__(self) -> Checkpointer:  # noqa: PYI034 - Self needs Python 3.11
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> None:
        try:
            self.close()
        except Exception as close_exc:  # never mask the user's exception
            if exc_type is None:
                raise
            print(f"stagesave: while handling another error: {close_exc}", file=sys.stderr)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a Checkpointer holds threads and buffers and cannot be pickled")
