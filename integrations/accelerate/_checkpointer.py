"""``AcceleratorCheckpointer``: Accelerate's ``save_state``/``load_state`` through stagesave.

``save_state`` gathers exactly what Accelerate would write (``_layout.py``), hands it to
``Checkpointer.save_dir`` and returns once it is staged in host memory; the folder appears only
when every file and the manifest are durable. ``load_state`` picks the checkpoint (the newest
*valid* one under automatic naming), proves it against its manifest, and then lets Accelerate's
own ``load_state`` read it, so restoring stays Accelerate's code, hooks and ``map_location``
rules included.

Runs that Accelerate saves through other machinery (FSDP, DeepSpeed, Megatron-LM, XLA) keep
Accelerate's synchronous methods, announced by one :class:`SynchronousFallbackWarning`.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagesave import Checkpointer, CheckpointInfo, SaveHandle

from . import _dist, _remote
from ._config import Options, is_switched_off, resolve_options
from ._hooks import run_save_hooks
from ._layout import MANIFEST_KEY, collect_rng_state, state_files
from ._restore import LoadPlan, discard_copy, plan_explicit, plan_newest

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AcceleratorCheckpointer", "SynchronousFallbackWarning"]

logger = logging.getLogger("stagesave.accelerate")

#: Accelerate's automatic naming: ``<project_dir>/checkpoints/checkpoint_<iteration>``.
CHECKPOINTS_DIR = "checkpoints"
FOLDER_PREFIX = "checkpoint_"

#: What Accelerate needs from an ``Accelerator`` for the asynchronous path.
_REQUIRED_ATTRS = (
    "_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects",
    "_save_model_state_pre_hook", "project_configuration", "scaler", "step", "get_state_dict",
)


class SynchronousFallbackWarning(UserWarning):
    """Issued once when an Accelerator keeps Accelerate's own synchronous save_state/load_state."""


def _fallback_reason(accelerator: Any) -> str | None:
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        return (
            f"{kind.value} runs save model and optimizer shards through {kind.value}'s own "
            "functions, which stagesave does not stage"
        )
    if kind == DistributedType.XLA:
        return "XLA runs need xm.mark_step() and XLA-side saving, which stagesave does not do"
    missing = [a for a in _REQUIRED_ATTRS if not hasattr(accelerator, a)]
    if missing:
        import accelerate

        return (
            f"this Accelerate version ({accelerate.__version__}) lacks {', '.join(missing)}, "
            "which stagesave reads to reproduce save_state's layout"
        )
    return None


def _drop_placeholder(target: str) -> None:
    """Remove the empty folder ``Checkpointer.save_dir`` creates at the target while staging.

    The core's writability check makes the target folder itself (a core bug: the folder must
    appear only when committed), so Accelerate's own ``load_state`` or ``total_limit`` could see
    an empty ``checkpoint_<N>``. ``rmdir`` removes only an empty folder, never a committed one
    (the commit renames a populated staging folder into place).
    """
    try:
        os.rmdir(target)
    except OSError:
        pass


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

    def __init__(self, accelerator: Any, *, options: Options | None = None, **overrides: Any) -> None:
        self.accelerator = accelerator
        self.options = options if options is not None else resolve_options(overrides)
        cls = type(accelerator)
        # The class's methods, bound: the real ones even when the instance is patched.
        self._accelerate_save = cls.save_state.__get__(accelerator, cls)
        self._accelerate_load = cls.load_state.__get__(accelerator, cls)
        self._checkpointers: dict[tuple[str, int | None], Checkpointer] = {}
        self.last_handle: SaveHandle | None = None
        self.synchronous_reason: str | None = None
        if is_switched_off():
            self.synchronous_reason = "switched off by STAGESAVE_ACCELERATE"
            logger.info("stagesave.accelerate is switched off by STAGESAVE_ACCELERATE; using Accelerate's save_state")
        else:
            reason = _fallback_reason(accelerator)
            if reason is not None:
                self.synchronous_reason = reason
                warnings.warn(
                    f"stagesave.accelerate: {reason}; save_state and load_state stay Accelerate's own "
                    "synchronous methods for this Accelerator (no checkpoint is written asynchronously).",
                    SynchronousFallbackWarning,
                    stacklevel=3,
                )

    # ------------------------------------------------------------------ properties
    @property
    def asynchronous(self) -> bool:
        """Whether saves go through stagesave (False: Accelerate's synchronous methods)."""
        return self.synchronous_reason is None

    @property
    def checkpoints_root(self) -> str:
        """Where automatic naming puts ``checkpoint_<N>`` folders (path or URL).

        Raises:
            ValueError: neither ``destination`` nor the Accelerator's ``project_dir`` is set.
        """
        if self.options.destination is not None:
            return _remote.normalize(self.options.destination)
        project_dir = self.accelerator.project_dir
        if project_dir is None:
            raise ValueError(
                "automatic checkpoint naming needs ProjectConfiguration(project_dir=...) or the "
                "stagesave option destination="
            )
        return _remote.normalize(os.path.join(project_dir, CHECKPOINTS_DIR))

    def _writes(self) -> bool:
        acc = self.accelerator
        if acc.project_configuration.save_on_each_node:
            return bool(acc.is_local_main_process)
        return bool(acc.is_main_process)

    def _checkpointer(self, automatic: bool = False) -> Checkpointer:
        """The Checkpointer for automatic-naming saves (with retention) or for explicit folders."""
        keep = self.accelerator.project_configuration.total_limit if automatic else None
        key = ("auto", keep) if automatic else ("plain", None)
        ckpt = self._checkpointers.get(key)
        if ckpt is None:
            o = self.options
            ckpt = Checkpointer(
                max_pending=o.max_pending, checksum=o.checksum, keep_last=keep, io_threads=o.io_threads,
                direct_io=o.direct_io, storage_options=dict(o.storage_options),
            )
            self._checkpointers[key] = ckpt
        return ckpt

    # ------------------------------------------------------------------ saving
    def save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> SaveHandle | None:
        """Stage everything ``Accelerator.save_state`` saves and write it in the background.

        Same arguments as ``Accelerator.save_state``; ``output_dir`` may be an fsspec URL.
        Returns the save's handle (its ``path`` is the folder), or ``None`` on processes that
        write nothing and when Accelerate's synchronous method ran instead.

        Raises:
            ValueError: no ``output_dir`` without automatic naming; the automatic folder already
                holds a valid checkpoint (as Accelerate refuses too).
            CheckpointError: an earlier background save failed; the target cannot be written.
            UnsupportedObjectError: a state holds something stagesave cannot save, or a save
                pre-hook wrote a file other than safetensors.
        """
        if not self.asynchronous:
            self._accelerate_save(output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs)
            return None
        _, handle = self._save(output_dir, safe_serialization)
        return handle

    def _save(self, output_dir: Any, safe_serialization: bool) -> tuple[str, SaveHandle | None]:
        acc = self.accelerator
        config = acc.project_configuration
        automatic = bool(config.automatic_checkpoint_naming)
        iteration = int(config.iteration)
        if automatic:
            target = _remote.join(self.checkpoints_root, f"{FOLDER_PREFIX}{iteration}")
        elif output_dir is None:
            raise ValueError(
                "save_state needs output_dir unless ProjectConfiguration(automatic_checkpoint_naming=True)"
            )
        else:
            target = _remote.normalize(output_dir)
        writer = self._writes()
        weights = [acc.get_state_dict(model, unwrap=False) for model in acc._models]
        handle: SaveHandle | None = None
        with run_save_hooks(acc, weights, _remote.leaf(target)) as hook_files:
            rng = collect_rng_state(int(acc.step))
            rng_states = _dist.gather_to_writers(
                rng, int(acc.process_index), int(acc.num_processes), bool(config.save_on_each_node)
            )
            if writer:
                handle = self._write(target, automatic, iteration, safe_serialization, weights, rng_states, hook_files)
        config.iteration = iteration + 1
        return target, handle

    def _write(
        self, target: str, automatic: bool, iteration: int, safe_serialization: bool, weights: list[Any],
        rng_states: dict[int, Any], hook_files: dict[str, Any],
    ) -> SaveHandle:
        """On a writing process: check the target, then stage every file and submit the folder."""
        acc = self.accelerator
        ckpt = self._checkpointer(automatic)
        if automatic:
            self._refuse_existing(ckpt, target, iteration, users_folder=not _remote.is_url(target))
        elif not _remote.is_url(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
        files = {**hook_files, **state_files(acc, weights, safe_serialization, rng_states)}
        metadata = {
            MANIFEST_KEY: {
                "iteration": iteration,
                "step": int(acc.step),
                "num_processes": int(acc.num_processes),
                "safe_serialization": bool(safe_serialization),
                "automatic_checkpoint_naming": automatic,
            }
        }
        existed = _remote.is_url(target) or os.path.lexists(target)
        handle = ckpt.save_dir(files, target, metadata=metadata)
        if not existed:
            _drop_placeholder(target)
        self.last_handle = handle
        return handle

    def _refuse_existing(self, ckpt: Checkpointer, target: str, iteration: int, *, users_folder: bool) -> None:
        """Accelerate's rule for automatic names, with torn folders replaced instead of fatal.

        ``users_folder``: a folder without manifest there may be Accelerate's own (a local
        folder); at a URL only a crashed stagesave save leaves one.

        Raises:
            ValueError: a valid checkpoint, or a plain local folder stagesave cannot prove, is
                already at ``target``.
        """
        if users_folder and not os.path.lexists(target):
            return
        try:
            info = ckpt.verify(target)
        except FileNotFoundError:
            return
        refuse = (
            f"Checkpoint directory {target} ({iteration}) already exists. Please manually override "
            "`self.save_iteration` with what iteration to start with."
        )
        if info.valid and info.manifest is not None:
            raise ValueError(refuse)
        if info.status == "unverified" and users_folder:
            raise ValueError(f"{refuse} (It has no stagesave manifest, so stagesave does not replace it.)")
        problem = "; ".join(info.problems) or "incomplete"
        warnings.warn(f"stagesave: replacing the invalid checkpoint {target} ({problem})", stacklevel=5)

    # ------------------------------------------------------------------ loading
    def load_state(
        self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> str | None:
        """Restore from ``input_dir``, or under automatic naming from the newest valid checkpoint.

        Waits for this process's pending saves first. The checkpoint is proven against its
        manifest (every byte when ``verify_on_load``) and then read by Accelerate's own
        ``load_state``. Under automatic naming ``ProjectConfiguration.iteration`` continues after
        the loaded checkpoint. Returns the folder loaded (``None`` on the synchronous path).

        Raises:
            ValueError: ``input_dir`` does not exist, or no ``input_dir`` without automatic naming.
            CheckpointNotFoundError: automatic naming found no checkpoint at all.
            IntegrityError: the named checkpoint is corrupt (automatic naming skips such ones).
            CheckpointError: a pending background save failed.
        """
        if not self.asynchronous:
            self._accelerate_load(input_dir, load_kwargs, **load_model_func_kwargs)
            return None
        acc = self.accelerator
        world = int(acc.num_processes)
        for ckpt in list(self._checkpointers.values()):
            ckpt.wait()
        _dist.barrier(world)  # every writer's saves are committed before anyone chooses
        chosen: tuple[LoadPlan | None, BaseException | None] = (None, None)
        if int(acc.process_index) == 0:
            try:
                chosen = (self._plan(input_dir), None)
            except Exception as exc:  # noqa: BLE001 - every process raises the same error below
                chosen = (None, exc)
        received: tuple[LoadPlan | None, BaseException | None] = _dist.broadcast_from_main(chosen, world)
        plan, error = received
        if error is not None:
            raise error
        assert plan is not None
        local, own_copy = plan.local, None
        if plan.remote:
            if os.path.isdir(local):  # rank 0's copy, on this host
                own_copy = local if int(acc.process_index) == 0 else None
            else:  # another host: fetch this host's own copy
                local = own_copy = _remote.download_folder(plan.folder, self.options.storage_options)
        try:
            self._accelerate_load(local, load_kwargs, **load_model_func_kwargs)
            _dist.barrier(world)  # nobody removes a copy another process still reads
        finally:
            if own_copy is not None:
                discard_copy(own_copy)
        config = acc.project_configuration
        if plan.iteration is not None and (config.automatic_checkpoint_naming or plan.from_manifest):
            config.iteration = plan.iteration + 1
        return plan.folder

    def _plan(self, input_dir: str | os.PathLike[str] | None) -> LoadPlan:
        options = self.options
        storage = dict(options.storage_options)
        if input_dir is not None:
            return plan_explicit(self._checkpointer(), input_dir, options.verify_on_load, storage)
        if not self.accelerator.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        return plan_newest(self._checkpointer(automatic=True), self.checkpoints_root, options.verify_on_load, storage)

    # ------------------------------------------------------------------ finding, waiting
    def latest(self) -> CheckpointInfo | None:
        """The newest valid checkpoint folder under automatic naming (``None`` if none)."""
        root = self.checkpoints_root
        ckpt = self._checkpointer(automatic=True)
        ckpt.latest(root)
        return next((c for c in ckpt.list(root) if c.is_dir and c.valid), None)

    def pending(self) -> int:
        """Saves of this process not committed yet."""
        return sum(c.pending() for c in self._checkpointers.values())

    def wait(self, timeout: float | None = None) -> None:
        """Block until this process's saves are committed.

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            CheckpointError: a background save failed.
        """
        for ckpt in list(self._checkpointers.values()):
            ckpt.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish pending saves, release buffers and threads (safe to call twice).

        Raises:
            TimeoutError: saves still running after ``timeout`` seconds (not committed).
            CheckpointError: a background save failed.
        """
        checkpointers, self._checkpointers = list(self._checkpointers.values()), {}
        errors: list[BaseException] = []
        for ckpt in checkpointers:
            try:
                ckpt.close(timeout)
            except BaseException as exc:  # noqa: BLE001 - close every one, then raise the first
                errors.append(exc)
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ installed methods
    def _installed_save_state(
        self, output_dir: str | os.PathLike[str] | None = None, safe_serialization: bool = True,
        **save_model_func_kwargs: Any,
    ) -> Path | str:
        """``Accelerator.save_state`` replacement: returns the folder, like Accelerate."""
        if not self.asynchronous:
            result: Path | str = self._accelerate_save(
                output_dir, safe_serialization=safe_serialization, **save_model_func_kwargs
            )
            return result
        target, _ = self._save(output_dir, safe_serialization)
        if _remote.is_url(target):
            return target
        acc = self.accelerator
        if output_dir is not None and not acc.project_configuration.automatic_checkpoint_naming:
            return Path(os.fspath(output_dir))  # as given, like Accelerate's return value
        if self.options.destination is None:
            return Path(os.path.join(acc.project_dir, CHECKPOINTS_DIR, _remote.leaf(target)))
        return Path(target)

    def _installed_load_state(
        self, input_dir: str | os.PathLike[str] | None = None, load_kwargs: dict[str, Any] | None = None,
        **load_model_func_kwargs: Any,
    ) -> None:
        """``Accelerator.load_state`` replacement (returns ``None``, like Accelerate)."""
        self.load_state(input_dir, load_kwargs, **load_model_func_kwargs)
