"""What :class:`StagedCheckpointIO` offers beyond Lightning's ``CheckpointIO`` contract: the
barriers and queries users call (``wait``, ``pending``, ``latest``), the telemetry the logging
callback collects, and what the wrapped Lightning methods (``_trainer_hooks.py``, ``_links.py``)
and the sharded strategies ask the plugin.

Lightning does not tell ``CheckpointIO`` who saves, which file ``fit(ckpt_path="last")`` chose,
or when ``ModelCheckpoint`` makes a ``save_last="link"`` link; the hooks learn it from the
``Trainer`` and pass it on through these methods, each a translation into the runtime or the core.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Any

from stagesave import SaveHandle, SaveTelemetry
from stagesave.saving.expected import will_exist

from ._runtime import Runtime

__all__ = ["StagedExtras"]


class StagedExtras:
    """The methods of :class:`StagedCheckpointIO` that ``CheckpointIO``'s contract lacks."""

    _run: Runtime
    verify_on_load: bool

    # ------------------------------------------------------------------ what the hooks ask
    def resume_path(self, path: Any) -> Any:
        """The checkpoint ``fit(ckpt_path="last")`` should resume from, given Lightning's choice.

        Lightning picks the newest ``last*.ckpt`` by modification time. That file is checked as
        :func:`stagesave.latest` checks a candidate (every byte with ``verify_on_load``; the load
        that follows does not hash it again): if it cannot be loaded, a warning names it and what
        is wrong, and the newest checkpoint in the same directory that can be loaded is used
        instead. With none, Lightning's choice stands and its load raises the error.
        """
        target = os.fspath(path)
        self._run.settle_link(target)
        try:
            chosen = self._run.checkpointer.resume_from(target, verify=self.verify_on_load)
        finally:
            self._run.release_if_idle()
        return path if chosen is None or chosen == target else chosen

    def resumed_fit(self, trainer: Any, path: Any) -> None:
        """``fit`` restored its state from ``path`` and Lightning let go of the loaded
        checkpoint (``resume_end``): make the staging buffer of the fit's first save now, on a
        thread, while the loop starts (:meth:`stagesave.Checkpointer.prepare_buffer`, the file's
        size), and keep it for the fit (released at teardown).

        Only where that save will come and be alike: the rank that writes, a local file, and a
        ``ModelCheckpoint`` that saves whole checkpoints (not ``save_weights_only``) at some
        interval. Anything else (a validate/test/predict, a sharded or remote checkpoint, no
        checkpointing) makes nothing.
        """
        from lightning.pytorch.trainer.states import TrainerFn

        target = os.fspath(path)
        if (trainer.state.fn != TrainerFn.FITTING or not trainer.is_global_zero
                or "://" in target or not os.path.isfile(target)
                or not saves_whole_checkpoints(trainer)):
            return
        self._run.keep_until_teardown()
        self._run.checkpointer.prepare_buffer(os.path.getsize(target))

    def saving(self, *, asynchronous: bool) -> AbstractContextManager[None]:
        """Saves made on this thread inside the block are asynchronous (``True``: the fit loop
        runs and hides the write) or return once committed (``False``: nothing to overlap).

        The plugin's ``Trainer.save_checkpoint`` hook sets this for every trainer save; a save
        made without it (Fabric, a direct call) is asynchronous.
        """
        return self._run.saving(asynchronous=asynchronous)

    def will_exist(self, path: Any) -> bool | None:
        """Whether ``path`` will exist once the operations pending on it in this process ran
        (``True``: its last pending operation is a save; ``False``: a removal); ``None`` when
        nothing is pending on it (ask the filesystem)."""
        return will_exist(os.fspath(path))

    def track(self, path: Any, handle: SaveHandle) -> None:
        """Record ``handle`` as the pending save of ``path`` (a link to ``path`` made later
        moves only if that save commits). The sharded strategies register their saves here."""
        self._run.track(os.fspath(path), handle)

    def link(self, target: Any, link: Any) -> None:
        """Point the symlink ``link`` at ``target`` once ``target`` is committed (atomically).

        ``ModelCheckpoint(save_last="link")`` calls this through the trainer; the link never
        points at a checkpoint that is still being written.

        Raises:
            ValueError: ``link`` is a URL (links exist on local filesystems only).
        """
        target_s, link_s = os.fspath(target), os.fspath(link)
        if "://" in link_s:
            raise ValueError(f"cannot link {link_s}: save_last='link' needs a local directory")
        self._run.link(target_s, link_s)

    # ------------------------------------------------------------------ barriers and queries
    def pop_telemetry(self) -> list[SaveTelemetry]:
        """Telemetry of the saves finished since the last call (oldest first)."""
        return self._run.pop_telemetry()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted save, removal and link update has finished.

        The one-line barrier before reading a checkpoint file directly:
        ``trainer.strategy.checkpoint_io.wait()`` (loads through the plugin wait by themselves).

        Raises:
            TimeoutError: still running after ``timeout`` seconds.
            stagesave.CheckpointError: a background save failed (raised once).
        """
        self._run.wait(timeout)

    def pending(self) -> int:
        """Saves, removals and link updates not finished yet."""
        return self._run.pending()

    def latest(self, dirpath: Any, *, verify: bool = True) -> str | None:
        """Path of the newest checkpoint in ``dirpath`` that a resume can load (after this
        plugin's pending saves), or ``None``; use it as ``trainer.fit(ckpt_path=...)``.

        Verified unless ``verify=False``, as :func:`stagesave.lightning.latest`."""
        self.wait()
        try:
            info = self._run.checkpointer.latest(os.fspath(dirpath), verify=verify)
        finally:
            self._run.release_if_idle()
        return None if info is None else info.path


def saves_whole_checkpoints(trainer: Any) -> bool:
    """Whether a ``ModelCheckpoint`` of ``trainer`` saves whole checkpoints (not weights only)
    at some interval, keeping some (``save_top_k`` or ``save_last``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return any(
        isinstance(cb, ModelCheckpoint) and not cb.save_weights_only
        and (cb.save_top_k != 0 or bool(cb.save_last))
        and bool(getattr(cb, "_every_n_train_steps", 1) or getattr(cb, "_every_n_epochs", 1)
                 or getattr(cb, "_train_time_interval", None) is not None)
        for cb in trainer.checkpoint_callbacks
    )
