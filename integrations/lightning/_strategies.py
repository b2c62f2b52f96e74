"""FSDP and ModelParallel strategies whose sharded checkpoints go through stagesave.

Lightning's ``FSDPStrategy(state_dict_type="sharded")`` and ``ModelParallelStrategy`` save and
load sharded checkpoints themselves, calling ``torch.distributed.checkpoint`` directly instead
of their ``CheckpointIO``; a plugin alone cannot reach them. These subclasses change only that:
the sharded save stages and returns (:mod:`._sharded`), the load reads through stagesave's
verifying DCP reader, and teardown flushes the plugin (Lightning's versions of these strategies
never call ``CheckpointIO.teardown``). Everything else, full-state-dict checkpoints included
(which do go through ``CheckpointIO``), is Lightning's own code. The strategy brings its own
:class:`StagedCheckpointIO` unless one is given, so a user swaps one object and adds nothing.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import stagesave.dcp as sdcp
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from stagesave.dcp import StagedStorageReader

from ._plugin import StagedCheckpointIO, find_plugin
from ._sharded import ShardedCheckpoints

__all__ = ["StagedFSDPStrategy", "StagedModelParallelStrategy"]

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy as _Base
else:
    _Base = object


class _StagedSharding(_Base):
    """What both strategies change: sharded save/load through stagesave, flush at teardown."""

    #: Key of the model's state in the DCP folder (Lightning's, per strategy).
    _model_key: str = "state_dict"

    def _sharded_checkpoints(self) -> bool:
        """Whether checkpoints are sharded folders (each strategy says when)."""
        return False

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The strategy's ``CheckpointIO``: a :class:`StagedCheckpointIO` unless one was given."""
        if self._checkpoint_io is None:
            self._checkpoint_io = StagedCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

    @property
    def _shards(self) -> ShardedCheckpoints:
        shards = self.__dict__.get("_stagesave_shards")
        if shards is None:
            shards = self.__dict__["_stagesave_shards"] = ShardedCheckpoints()
        return shards

    def _staged_io(self) -> StagedCheckpointIO:
        plugin = find_plugin(self)
        if plugin is None:
            raise TypeError(
                f"{type(self).__name__} writes sharded checkpoints through a StagedCheckpointIO, "
                f"but its checkpoint_io is a {type(self.checkpoint_io).__name__}. Remove the "
                "other CheckpointIO plugin, or pass StagedCheckpointIO(...) as the plugin."
            )
        return plugin

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Save a sharded checkpoint folder (returns once staged) or, otherwise, as Lightning does.

        Raises:
            TypeError: ``storage_options`` with a sharded checkpoint (Lightning refuses them too).
            ValueError: a URL: Lightning writes sharded checkpoints to local directories only.
            stagesave.CheckpointError: staging failed here or on another rank, or an earlier
                background save failed.
        """
        if not self._sharded_checkpoints():
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not "
                "supported for sharded checkpoints (Lightning does not pass them to sharded "
                "saves either)"
            )
        path = os.fspath(self.broadcast(filepath))
        if "://" in path:
            raise ValueError(
                f"cannot save a sharded checkpoint to {path}: Lightning's sharded checkpoints "
                "are local folders; use a local or mounted directory as "
                "ModelCheckpoint(dirpath=...)"
            )
        state: dict[str, Any] = {self._model_key: checkpoint.pop("state_dict")}
        for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{i}"] = optim_state
        self._shards.save(self._staged_io(), state, checkpoint, os.path.abspath(path))

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a sharded folder (written by stagesave or by Lightning) into the sharded model
        and optimizers and return the rest of the checkpoint; a single file as Lightning does.

        Raises:
            stagesave.CheckpointNotFoundError: the folder has no ``meta.pt``.
            stagesave.IntegrityError: the folder does not match its proof.
            stagesave.UnsafeCheckpointError: an item needs a class that is not allow-listed.
        """
        path = os.fspath(self.broadcast(checkpoint_path))
        if not os.path.isdir(path):
            plugin = find_plugin(self)
            if plugin is not None:
                plugin.wait()  # a full checkpoint still being written by this plugin
            return super().load_checkpoint(path, weights_only)
        plugin = self._staged_io()
        module, lightning_module = self.model, self.lightning_module
        assert module is not None and lightning_module is not None
        fitting = lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = list(self.optimizers) if fitting else []
        strict = lightning_module.strict_loading

        def fill(reader: StagedStorageReader) -> None:
            self._load_sharded(reader, path, module, optimizers, strict)

        return self._shards.load(plugin, path, weights_only, fill)

    def _load_sharded(
        self,
        reader: StagedStorageReader,
        path: str,
        module: Module,
        optimizers: list[Optimizer],
        strict: bool,
    ) -> None:
        """Fill the model and optimizers in place from the folder (DTensor state: FSDP2, TP).

        Templates from the live model and optimizers tell DCP which shard each rank needs, so
        a folder saved on another number of ranks reshards on load.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state: dict[str, Any] = {self._model_key: get_model_state_dict(module)}
        for i, optimizer in enumerate(optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(module, optimizer)
        sdcp.load(state, path, reader=reader)
        options = StateDictOptions(strict=strict)
        set_model_state_dict(module, state[self._model_key], options=options)
        for i, optimizer in enumerate(optimizers):
            set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"])

    @override
    def teardown(self) -> None:
        """Lightning's teardown, then flush the plugin: pending sharded saves commit first."""
        super().teardown()
        self._shards.close()
        self.checkpoint_io.teardown()


class StagedFSDPStrategy(_StagedSharding, FSDPStrategy):
    """``FSDPStrategy`` whose checkpoints cost training one copy into host memory.

    A drop-in for ``FSDPStrategy`` (same arguments). With ``state_dict_type="sharded"`` every
    rank stages its shards and the folder is committed in the background once all are durable;
    with ``"full"`` the gathered checkpoint goes through the :class:`StagedCheckpointIO`. Pass
    ``checkpoint_io=StagedCheckpointIO(...)`` (or ``Trainer(plugins=[...])``) to configure it.
    """

    _model_key = "model"

    def _sharded_checkpoints(self) -> bool:
        return self._state_dict_type == "sharded"

    @override
    def _load_sharded(
        self,
        reader: StagedStorageReader,
        path: str,
        module: Module,
        optimizers: list[Optimizer],
        strict: bool,
    ) -> None:
        """FSDP1 (``ShardedTensor`` state): the optimizer state is laid out from the folder's
        metadata and the model's shards (torch's ``load_sharded_optimizer_state_dict``), since
        a rank's live optimizer lacks state for parameters it holds no shard of."""
        from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model_state = get_model_state_dict(module)
        sdcp.load({self._model_key: model_state}, path, reader=reader)
        set_model_state_dict(module, model_state, options=StateDictOptions(strict=strict))
        for i, optimizer in enumerate(optimizers):
            key = f"optimizer_{i}"
            loaded = load_sharded_optimizer_state_dict(
                model_state_dict=model_state, optimizer_key=key, storage_reader=reader
            )
            set_optimizer_state_dict(module, optimizer, loaded[key])


class StagedModelParallelStrategy(_StagedSharding, ModelParallelStrategy):
    """``ModelParallelStrategy`` whose checkpoints cost training one copy into host memory.

    A drop-in for ``ModelParallelStrategy``: the same arguments, plus ``checkpoint_io`` (a
    :class:`StagedCheckpointIO` by default). With ``save_distributed_checkpoint=True`` (the
    default) every rank stages its shards and the folder is committed in the background.
    """

    _model_key = "state_dict"

    def __init__(
        self,
        data_parallel_size: int | Literal["auto"] = "auto",
        tensor_parallel_size: int | Literal["auto"] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        checkpoint_io: CheckpointIO | None = None,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._checkpoint_io = checkpoint_io

    def _sharded_checkpoints(self) -> bool:
        return self._save_distributed_checkpoint
