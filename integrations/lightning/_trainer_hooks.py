"""What the plugin learns from the ``Trainer``: whether a save sits inside the fit loop, and
what ``ModelCheckpoint`` should believe exists.

``CheckpointIO.save_checkpoint`` is not told who calls it. A save made while ``fit`` runs has
training to hide behind; any other save (after ``fit`` returned, from ``validate``/``test``/
``predict``, from user code between runs) has nothing to overlap, and the caller usually reads,
copies or uploads the file next. So ``Trainer.save_checkpoint`` is wrapped, for trainers whose IO
is the plugin only, to tell the plugin which of the two it is (``StagedCheckpointIO.saving``).

``ModelCheckpoint.file_exists`` decides version suffixes (``name-v1.ckpt``) by asking the
filesystem; a checkpoint whose save is still pending is not there yet, so the callback would
overwrite it instead of versioning. The wrapped method also counts a pending save as existing
(and a pending removal as gone).

``fit(ckpt_path="last")`` resolves to the newest ``last*.ckpt`` by modification time. The
wrapped ``_CheckpointConnector._parse_ckpt_path`` hands that choice to the plugin, which keeps
it if it can be loaded and otherwise names what is wrong and resumes from the newest checkpoint
beside it that can (``StagedCheckpointIO.resume_path``). Trainers without the plugin get
Lightning's methods unchanged.

With ``StagedCheckpointIO(prepare_buffer=...)`` (by default: a fit on an accelerator), a fit
that resumed from a local checkpoint makes its first save's staging buffer once the connector's
``resume_end`` has let go of the loaded checkpoint (``StagedExtras.resumed_fit``): made earlier,
it would add to the memory the load holds. A fit that starts afresh makes it at the first
``ModelCheckpoint.on_train_batch_end`` after an optimizer step (before the callback decides
whether to save: the optimizers' state exists by then), sized by the module's and the
optimizers' tensors (``StagedExtras.trained_a_batch``). Both only inside ``fit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["in_fit_loop", "install_trainer_hooks"]

_MARK = "__stagesave_hook__"


def in_fit_loop(trainer: Any) -> bool:
    """Whether ``trainer`` is inside ``fit`` (training, validating or in its end hooks)."""
    from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

    state = trainer.state
    return bool(state.fn == TrainerFn.FITTING and state.status == TrainerStatus.RUNNING)


def _wrap(owner: type, name: str, make: Callable[[Any], Any]) -> None:
    original = owner.__dict__.get(name)
    if original is None or getattr(original, _MARK, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


def install_trainer_hooks(find_plugin: Callable[[Any], Any]) -> None:
    """Wrap ``Trainer.save_checkpoint``, ``ModelCheckpoint.file_exists`` and
    ``on_train_batch_end``, the connector's ``"last"`` resolution and its ``resume_end`` (once
    per process).

    ``find_plugin(trainer)`` returns the trainer's ``StagedCheckpointIO`` or ``None``.
    """
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    def make_save(original: Any) -> Any:
        def save_checkpoint(
            self: Any, filepath: Any, weights_only: Any = None, storage_options: Any = None
        ) -> None:
            plugin = find_plugin(self)
            if plugin is None:
                return original(self, filepath, weights_only, storage_options)  # type: ignore[no-any-return]
            with plugin.saving(asynchronous=in_fit_loop(self)):
                return original(self, filepath, weights_only, storage_options)  # type: ignore[no-any-return]

        return save_checkpoint

    def make_exists(original: Any) -> Any:
        def file_exists(self: Any, filepath: Any, trainer: Any) -> bool:
            plugin = find_plugin(trainer)
            if plugin is None:
                return original(self, filepath, trainer)  # type: ignore[no-any-return]
            local = False
            if trainer.is_global_zero:
                expected = plugin.will_exist(filepath)
                local = self._fs.exists(filepath) if expected is None else expected
            return bool(trainer.strategy.reduce_boolean_decision(local, all=False))

        return file_exists

    def make_parse(original: Any) -> Any:
        def _parse_ckpt_path(self: Any, state_fn: Any, ckpt_path: Any, model_provided: bool,
                             model_connected: bool) -> Any:
            chosen = original(self, state_fn, ckpt_path, model_provided, model_connected)
            plugin = find_plugin(self.trainer)
            if plugin is None or chosen is None or ckpt_path != "last":
                return chosen
            return plugin.resume_path(chosen)

        return _parse_ckpt_path

    def make_resume_end(original: Any) -> Any:
        def resume_end(self: Any) -> None:
            path = self._ckpt_path  # what the run restored from (None: nothing)
            original(self)  # frees the loaded checkpoint
            plugin = find_plugin(self.trainer)
            if plugin is not None and path:
                plugin.resumed_fit(self.trainer, path)

        return resume_end

    def make_batch_end(original: Any) -> Any:
        def on_train_batch_end(self: Any, trainer: Any, *args: Any, **kwargs: Any) -> None:
            plugin = find_plugin(trainer)
            if plugin is not None:
                plugin.trained_a_batch(trainer)  # the first one: the first save's buffer
            return original(self, trainer, *args, **kwargs)  # type: ignore[no-any-return]

        return on_train_batch_end

    _wrap(Trainer, "save_checkpoint", make_save)
    _wrap(ModelCheckpoint, "on_train_batch_end", make_batch_end)
    _wrap(_CheckpointConnector, "resume_end", make_resume_end)
    _wrap(_CheckpointConnector, "_parse_ckpt_path", make_parse)
    _wrap(ModelCheckpoint, "file_exists", make_exists)
