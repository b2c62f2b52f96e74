"""``AcceleratorCheckpointer``: Accelerate's ``save_state``/``load_state`` through stagesave.

``save_state`` gathers exactly what Accelerate would write (``_layout.py``), hands it to
``Checkpointer.save_dir`` (``_save.py``) and returns once it is staged in host memory when it
sits inside a training loop (``_training.py``), once committed otherwise; the folder appears
only when every file, each with its proof inside, is durable (it holds exactly Accelerate's
files: one of them, the carrier, also proves the set of files and records the save's
``{"accelerate": {...}}`` metadata). Under FSDP (``SHARDED_STATE_DICT``) every rank stages its
shards through ``stagesave.dcp`` (``_fsdp.py``) and the folder is published once every part
committed (``_sharded.py``, over :mod:`stagesave.saving.assemble`). ``load_state`` picks the
checkpoint (the newest *valid* one under automatic naming, ``_restore.py``), proves it against
the proofs its files carry, and then lets Accelerate's own ``load_state`` read it
(``_load.py``), so restoring stays Accelerate's code, hooks and ``map_location`` rules included
(FSDP's DCP folders are read through ``stagesave.dcp``'s reader).

Runs that Accelerate saves through other machinery keep Accelerate's synchronous methods
(``_support.py``).
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import TYPE_CHECKING, Any

from stagesave import Checkpointer, CheckpointInfo, SaveHandle, SaveTelemetry, TieredStore
from stagesave.stores import urls

from ._ahead import first_save_bytes, logged, makes_buffer_ahead
from ._config import Options, check_options, resolve_options, telemetry_target
from ._load import choose_plan, load_everywhere
from ._resources import Resources
from ._roots import AutoRoot, checkpoints_root, tier_of
from ._save import save_replicated, target_of
from ._sharded import save_sharded
from ._support import synchronous_reason
from ._training import TrainingSignal
from ._trust import guarded, unlisted_reads

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AcceleratorCheckpointer"]


class AcceleratorCheckpointer:
    """Asynchronous ``save_state``/``load_state`` for one ``Accelerator``, without patching it.

    Call :meth:`save_state` and :meth:`load_state` where you would call the Accelerator's.
    :func:`stagesave.accelerate.enable` builds one of these and installs its methods on the
    Accelerator instead.

    Args:
        accelerator: A constructed ``accelerate.Accelerator``.
        options: Ready-made :class:`~stagesave.accelerate.Options`; when omitted they come from
            ``overrides``, the ``STAGESAVE_ACCELERATE_*`` environment and the side file.
        **overrides: Individual options (``destination=``, ``max_pending=``, ...).

    Raises:
        TypeError: an unknown option was passed.
        ValueError: an option (argument, environment variable, side file) is unusable.
    """

    def __init__(
        self, accelerator: Any, *, options: Options | None = None, **overrides: Any
    ) -> None:
        # Held weakly: the Accelerator holds this object (``enable()``), never the reverse, so
        # dropping the Accelerator frees it and the finalizers below give the threads back.
        self._accelerator_ref = weakref.ref(accelerator)
        self.options = options if options is not None else resolve_options(overrides)
        check_options(self.options)
        # The class's methods: the real ones even when the instance is patched.
        self._cls = type(accelerator)
        self._res = Resources(self.options, telemetry_target(accelerator, self.options))
        self.last_handle: SaveHandle | None = None
        self._used = False
        self.synchronous_reason = synchronous_reason(accelerator, self.options)
        from accelerate.utils import DistributedType

        self._fsdp = self.asynchronous and accelerator.distributed_type == DistributedType.FSDP
        self._training = TrainingSignal(accelerator, weakref.WeakMethod(self._first_step))
        for owner in (accelerator, self):  # whichever goes first gives threads and buffers back
            weakref.finalize(owner, self._res.close_quietly).atexit = False  # exit: the core's hook

    # ------------------------------------------------------------------ properties
    @property
    def accelerator(self) -> Any:
        """The Accelerator this checkpointer serves.

        Raises:
            ReferenceError: it was garbage collected (this checkpointer has nothing left to save).
        """
        acc = self._accelerator_ref()
        if acc is None:
            raise ReferenceError(
                "the Accelerator of this AcceleratorCheckpointer was garbage collected"
            )
        return acc

    def _accelerate_save(self, *args: Any, **kwargs: Any) -> Any:
        return self._cls.save_state(self.accelerator, *args, **kwargs)

    def _accelerate_load(self, *args: Any, **kwargs: Any) -> Any:
        return self._cls.load_state(self.accelerator, *args, **kwargs)

    @property
    def used(self) -> bool:
        """Whether a save or load went through this checkpointer."""
        return self._used

    @property
    def asynchronous(self) -> bool:
        """Whether saves go through stagesave (False: Accelerate's synchronous methods)."""
        return self.synchronous_reason is None

    @property
    def checkpoints_root(self) -> str:
        """Where automatic naming puts ``checkpoint_<N>`` folders (path or URL; the remote tier's
        URL when ``local_tier`` is set).

        Raises:
            ValueError: neither ``destination`` nor the Accelerator's ``project_dir`` is set.
        """
        dest = self.options.destination
        return checkpoints_root(dest, self.accelerator.project_dir if dest is None else None)

    @property
    def _auto(self) -> AutoRoot:
        tier = self.options.local_tier
        return AutoRoot(self.checkpoints_root, urls.normalize(tier) if tier is not None else None)

    @property
    def tiered_store(self) -> TieredStore | None:
        """The :class:`stagesave.TieredStore` behind automatic naming with ``local_tier``
        (``None`` before the first use or without a local tier)."""
        return self._res.tiered

    def _checkpointer(self, kind: str = "plain") -> Checkpointer:
        """The Checkpointer for ``"auto"`` (automatic naming, with retention and the tiered
        root), ``"plain"`` (explicit folders) or ``"fsdp"`` (parts of FSDP checkpoints)."""
        ckpt = self._res.checkpointers.get(kind)
        if ckpt is None:
            auto = kind == "auto"
            keep = self.accelerator.project_configuration.total_limit if auto else None
            tiered = auto and self.options.local_tier is not None
            ckpt = self._res.open(kind, keep, self.checkpoints_root if tiered else None)
        return ckpt

    # ------------------------------------------------------------------ saving
    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> SaveHandle | None:
        """Stage everything ``Accelerator.save_state`` saves and write it in the background.

        Same arguments as ``Accelerator.save_state``; ``output_dir`` may be an fsspec URL.
        Inside a training loop (an optimizer of this Accelerator stepped since the previous
        ``save_state``/``load_state``) it returns once the state is staged; otherwise (and
        unless ``sync_outside_training=False``) it returns only once this process's part is
        committed, and raises a failure of the save there. Returns the save's handle (its
        ``path`` is the folder; ``result()`` waits for its commit), or ``None`` on processes
        that write no folder and when Accelerate's synchronous method ran instead.

        Raises:
            ValueError: no ``output_dir`` without automatic naming; the automatic folder already
                holds a valid checkpoint (as Accelerate refuses too); an FSDP save to a URL or
                over an existing folder.
            CheckpointError: an earlier background save failed; the target cannot be written;
                a save outside training failed to commit.
            UnsupportedObjectError: a state holds something stagesave cannot save.
        """
        if not self.asynchronous:
            self._accelerate_save(
                output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs
            )
            return None
        _, handle = self._save(output_dir, safe_serialization)
        return handle

    def _save(self, output_dir: Any, safe_serialization: bool) -> tuple[str, SaveHandle | None]:
        """Stage the save; wait for its commit unless it sits inside a training loop."""
        in_training = self._training.consume()
        self._used = True
        acc = self.accelerator
        config = acc.project_configuration
        target, auto, iteration = target_of(config, lambda: self._auto, output_dir)
        args = (auto, target, iteration, safe_serialization)
        if self._fsdp:
            handle = save_sharded(acc, self._checkpointer, self._res, *args)
        else:
            handle = save_replicated(acc, self._checkpointer, *args)
        if handle is not None:
            self.last_handle = handle
        config.iteration = iteration + 1
        if not in_training and self.options.sync_outside_training:
            self.wait()  # nothing to overlap it with: return committed (and raise its failure here)
        return target, handle

    def _first_step(self) -> None:
        """Every optimizer of the Accelerator has stepped (their state exists): make the first
        save's staging buffer now, on a thread, where that save will come through stagesave
        (``_ahead.py``)."""
        try:
            acc = self.accelerator
            if (not self.asynchronous or self._fsdp or self.options.device_staging
                    or not makes_buffer_ahead(acc, self.options.prepare_buffer)):
                return
            auto = bool(acc.project_configuration.automatic_checkpoint_naming)
            self._checkpointer("auto" if auto else "plain").prepare_buffer(first_save_bytes(acc))
        except Exception as exc:  # noqa: BLE001 - never break the training step it follows
            logged("at the first optimizer step", exc)

    # ------------------------------------------------------------------ loading
    def load_state(
        self, input_dir: str | os.PathLike[str] | None = None,
        load_kwargs: dict[str, Any] | None = None, **load_model_func_kwargs: Any,
    ) -> str | None:
        """Restore from ``input_dir``, or under automatic naming from the newest valid checkpoint.

        Waits for this process's pending saves first. The checkpoint is proven against the
        proofs its files carry (every byte when ``verify_on_load``; a file they do not list
        makes it corrupt) and then read by Accelerate's own ``load_state``, which may read only
        the files the proof lists and unpickles them with stagesave's safe unpickler (the full
        one with the ``trusted`` option). Under automatic naming
        ``ProjectConfiguration.iteration`` continues after the loaded checkpoint. Returns the
        folder loaded (``None`` on the synchronous path).

        Raises:
            ValueError: ``input_dir`` does not exist, or no ``input_dir`` without automatic naming.
            CheckpointNotFoundError: automatic naming found no checkpoint at all.
            IntegrityError: the named checkpoint is corrupt (automatic naming skips such ones),
                or holds a file its proof does not list.
            UnsafeCheckpointError: a file needs a class that is not allow-listed (the state read
                before it is already restored).
            CheckpointError: a pending background save failed.
        """
        if not self.asynchronous:
            with guarded(os.fspath(input_dir or ""), None, self.options.trusted):
                self._accelerate_load(input_dir, load_kwargs, **load_model_func_kwargs)
            return None
        self._training.consume()  # a save after a load (and no step) has nothing to overlap
        self._used = True
        acc = self.accelerator
        self.wait()
        read = functools.partial(self._accelerate_load, **load_model_func_kwargs)
        choose = functools.partial(
            choose_plan, input_dir, self.options, acc.project_configuration, self._checkpointer,
            lambda: self._auto, self._res,
            lambda local, names: unlisted_reads(acc, local, names, self._fsdp))
        plan = load_everywhere(acc, choose, lambda local: read(local, load_kwargs), self._fsdp,
                               self.options.storage_options, self.options.trusted)
        return plan.folder

    # ------------------------------------------------------------------ finding, waiting
    def latest(self) -> CheckpointInfo | None:
        """The newest valid checkpoint folder under automatic naming (``None`` if none).

        With ``local_tier``, its ``tier`` says which copy a resume reads (``"local"``/``"remote"``).
        """
        root = self._auto.list_arg
        ckpt = self._checkpointer("auto")
        # Warns about torn or invalid folders (proofs only, no byte read); repairs nothing: a
        # folder left aside by a crash is listed where it lies.
        ckpt.latest(root, verify=False)
        found = next((c for c in ckpt.list(root) if c.is_dir and c.valid), None)
        if found is not None and self._res.tiered is not None:
            found.tier = tier_of(self._res.tiered, found)
        return found

    def pending(self) -> int:
        """Saves of this process not committed (or, under FSDP, not published) yet."""
        return self._res.pending()

    def wait(self, timeout: float | None = None) -> None:
        """Block until this process's saves are committed (and FSDP checkpoints published).

        Uploads to the remote tier keep running; :meth:`wait_uploads` waits for those.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: a background save failed.
        """
        for ckpt in list(self._res.checkpointers.values()):
            ckpt.wait(timeout)

    def wait_uploads(self, timeout: float | None = None) -> list[SaveTelemetry]:
        """With ``local_tier``: wait until every committed checkpoint was uploaded (or failed).

        Returns the upload records since the last call (``error`` set on failed uploads, which
        are retried after the next save). Without a local tier there is nothing to wait for.

        Raises:
            TimeoutError: uploads still running after ``timeout`` seconds.
        """
        self.wait(timeout)
        tiered = self._res.tiered
        return tiered.wait_uploads(timeout) if tiered is not None else []

    def close(self, timeout: float | None = None) -> None:
        """Finish pending saves (and uploads), end the threads and free the staging buffers.

        Safe to call more than once; a later save or load creates them again. ``enable()`` calls
        it from ``end_training()``, ``free_memory()``/``clear()`` and ``disable()``; a garbage
        collected Accelerator (or checkpointer) is released the same way.

        Raises:
            TimeoutError: saves still running after ``timeout`` seconds (not committed).
            CheckpointError: a background save failed.
        """
        self._training.rearm()  # a later run's first save gets its buffer ahead again
        self._res.close(timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
