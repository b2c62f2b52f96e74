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
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from stagesave import SaveHandle, SaveTelemetry
from stagesave.saving.expected import will_exist
from stagesave.saving.sizing import checkpoint_bytes

from ._runtime import Runtime, log
from ._trainer_hooks import in_fit_loop

__all__ = ["StagedExtras"]


class StagedExtras:
    """The methods of :class:`StagedCheckpointIO` that ``CheckpointIO``'s contract lacks."""

    _run: Runtime
    verify_on_load: bool
    prepare_buffer: bool | None

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
        target = os.fspath(path)
        with _never_in_the_way():
            if (not in_fit_loop(trainer) or "://" in target or not os.path.isfile(target)
                    or not self._ahead(trainer)):
                return
            self._run.sized_for_fit = True
            self._run.keep_until_teardown()
            self._run.checkpointer.prepare_buffer(os.path.getsize(target))

    def trained_a_batch(self, trainer: Any) -> None:
        """A ``ModelCheckpoint`` is told a training batch ended. The first time in a fit that did
        not resume, once an optimizer step was taken (its state exists then, also with gradient
        accumulation), make the staging buffer of the fit's first save on a thread, sized by
        the module's and the optimizers' tensors, as :meth:`resumed_fit` does from the file's
        size; same conditions."""
        run = self._run
        if run.sized_for_fit or trainer.global_step < 1:  # no optimizer step yet: no state
            return
        if not in_fit_loop(trainer):  # called by hand, outside fit: no teardown will follow
            return
        run.sized_for_fit = True
        with _never_in_the_way():
            if not self._ahead(trainer):
                return
            run.keep_until_teardown()
            run.checkpointer.prepare_buffer(training_state_bytes(trainer))

    def _ahead(self, trainer: Any) -> bool:
        """Whether to make the first save's buffer ahead (``prepare_buffer``; ``None``: when
        the fit trains on an accelerator) and this rank writes whole checkpoint files."""
        wanted = self.prepare_buffer
        if wanted is None:
            wanted = trainer.strategy.root_device.type != "cpu"
        return wanted and _writes_whole_files(trainer)

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


@contextmanager
def _never_in_the_way() -> Iterator[None]:
    """Making a buffer ahead is an optimisation: a failure to decide or to size it is logged
    (the first save makes its buffer, as without it), never raised into the training loop."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.warning("stagesave: the first save's staging buffer is not made ahead: %s: %s",
                    type(exc).__name__, exc)


def _writes_whole_files(trainer: Any) -> bool:
    """Whether this rank writes the fit's checkpoints as one file through the plugin (the rank
    that writes, a strategy that saves through ``CheckpointIO``) and some ``ModelCheckpoint``
    saves whole checkpoints at an interval."""
    from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
    from lightning.pytorch.strategies.deepspeed import DeepSpeedStrategy

    strategy = trainer.strategy
    return (trainer.is_global_zero and isinstance(strategy, (SingleDeviceStrategy, DDPStrategy))
            and not isinstance(strategy, DeepSpeedStrategy) and saves_whole_checkpoints(trainer))


def training_state_bytes(trainer: Any) -> int:
    """About the size of the fit's checkpoint file: the module's state and its optimizers'
    state tensors, as :func:`stagesave.saving.sizing.checkpoint_bytes` counts them."""

    def values() -> Iterator[Any]:
        yield from trainer.lightning_module.state_dict().values()
        for optimizer in trainer.optimizers:
            for per_param in optimizer.state.values():
                yield from per_param.values() if isinstance(per_param, dict) else ()

    return checkpoint_bytes(values())


def saves_whole_checkpoints(trainer: Any) -> bool:
    """Whether a ``ModelCheckpoint`` of ``trainer`` saves whole checkpoints (not weights only)
    at some interval, keeping some (``save_top_k`` or ``save_last``)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def whole(cb: Any) -> bool:
        try:
            return bool(
                isinstance(cb, ModelCheckpoint) and not cb.save_weights_only
                and (cb.save_top_k != 0 or cb.save_last)
                and (cb._every_n_train_steps or cb._every_n_epochs
                     or cb._train_time_interval is not None))
        except (AttributeError, TypeError, ValueError):  # a stand-in (a test's mock): not known
            return False

    return any(whole(cb) for cb in trainer.checkpoint_callbacks)
