"""``load_state`` after ``enable()`` reads only what the proof lists, and unpickles nothing that
could run code: hostile files written by someone with write access to the checkpoint folder
(one that re-proves the folder with consistent CRCs, and one that only drops files in) are
refused with a stagesave error before they can do anything; legit user classes load once
allow-listed, or with ``trusted=True``."""

from __future__ import annotations

import os
import pickle
import shutil
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import stagesave.accelerate as sa
import torch
from accel_helpers import assert_same, build, snapshot, train
from accelerate import Accelerator
from proofkit import carrier_of, rewrite_proof

import stagesave
from stagesave.errors import CheckpointError, IntegrityError, UnsafeCheckpointError


class Boom:
    """Unpickling it creates the folder ``marker`` (what an attacker's payload would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.marker,))


@dataclass
class HParams:
    """A user class inside a custom object's state (allow-listed in one test)."""

    lr: float
    name: str


@dataclass
class Schedule:
    """Another user class, loaded only with ``trusted=True``."""

    warmup: int


class Holder:
    """A custom checkpointed object whose state holds a user class."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def _saved(
    tmp_path, *, safe: bool = True, **options: Any
) -> tuple[Accelerator, dict[str, Any], str, dict[str, Any]]:
    """A trained run saved through stagesave; the run trained on afterwards (so a load shows)."""
    acc = Accelerator(cpu=True)
    run = build(acc)
    sa.enable(acc, **options)
    train(acc, run, 3)
    folder = str(tmp_path / "ck")
    acc.save_state(folder, safe_serialization=safe)
    sa.enabled(acc).wait()
    before = snapshot(acc, run)
    train(acc, run, 2)
    return acc, run, folder, before


def _payload(tmp_path) -> tuple[bytes, str]:
    """A custom-object file whose unpickling calls ``os.mkdir(marker)``."""
    marker = str(tmp_path / "PWNED")
    path = tmp_path / "payload.pkl"
    torch.save({"count": Boom(marker), "history": torch.zeros(4)}, path)
    return path.read_bytes(), marker


def _reprove(folder: str, name: str, data: bytes) -> None:
    """Put ``data`` at ``name`` and rewrite the carrier's proof to vouch for it (a listed file
    with its checksums), every CRC consistent: what an attacker without a key can do."""
    from stagesave.ondisk.checksum import digest

    def mutate(doc):
        step, algorithm = doc["chunk_bytes"], doc["algorithm"]
        f = doc["folder"]
        f["members"] = [m for m in f["members"] if m[0] != name]
        f["listed"] = [e for e in f["listed"] if e["name"] != name] + [{
            "name": name, "size": len(data), "algorithm": algorithm, "chunk_bytes": step,
            "chunks": [digest(algorithm, data[i : i + step]) for i in range(0, len(data), step)],
            "kind": "raw", "serialization_id": None, "id_offset": None, "storages": [],
        }]

    carrier = carrier_of(folder)
    assert os.path.basename(carrier) != name
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)
    rewrite_proof(carrier, mutate)


def _assert_not_restored(acc, run, before) -> None:
    now = snapshot(acc, run)
    with pytest.raises(AssertionError):
        assert_same(before["models"], now["models"])


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize(
    "name", ["custom_checkpoint_1.pkl", "random_states_0.pkl", "scheduler.bin"]
)
def test_a_reproved_malicious_pickle_is_refused_and_runs_nothing(tmp_path, verify, name):
    acc, _run, folder, _ = _saved(tmp_path, verify_on_load=verify)
    data, marker = _payload(tmp_path)
    if name == os.path.basename(carrier_of(folder)):
        pytest.skip(f"{name} carries the folder's proof here")
    _reprove(folder, name, data)
    assert stagesave.verify(folder).status == "verified"  # the attacker's proof holds up
    with pytest.raises(UnsafeCheckpointError) as err:
        acc.load_state(folder)
    assert name in str(err.value) and "trusted=True" in str(err.value)
    assert isinstance(err.value, CheckpointError)
    assert not os.path.exists(marker)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("how", ["added", "dropped-from-proof"])
def test_an_unlisted_malicious_pickle_is_refused_before_anything_loads(tmp_path, verify, how):
    acc, run, folder, before = _saved(tmp_path, verify_on_load=verify)
    data, marker = _payload(tmp_path)
    if how == "added":  # a third object registered, its file dropped in beside the listed ones
        name = "custom_checkpoint_2.pkl"
        acc.register_for_checkpointing(type(run["counters"][0])())
    else:  # the proof rewritten not to name the file, then the file replaced
        name = "custom_checkpoint_1.pkl"

        def mutate(doc):
            doc["folder"]["members"] = [m for m in doc["folder"]["members"] if m[0] != name]

        rewrite_proof(carrier_of(folder), mutate)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)
    with pytest.raises(IntegrityError) as err:
        acc.load_state(folder)
    assert name in str(err.value)
    assert not os.path.exists(marker)
    _assert_not_restored(acc, run, before)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_an_unlisted_safetensors_shadow_of_a_listed_bin_is_refused(tmp_path, verify):
    from safetensors.torch import save_file

    acc, run, folder, before = _saved(tmp_path, safe=False, verify_on_load=verify)
    assert os.path.exists(os.path.join(folder, "pytorch_model.bin"))
    state = run["models"][0].state_dict()
    save_file({k: torch.zeros_like(v) for k, v in state.items() if k != "out.weight"},
              os.path.join(folder, "model.safetensors"))  # Accelerate prefers it to the .bin
    with pytest.raises(IntegrityError) as err:
        acc.load_state(folder)
    assert "model.safetensors" in str(err.value)
    assert float(run["models"][0].inp.weight.detach().abs().sum()) != 0.0
    _assert_not_restored(acc, run, before)


def test_a_plain_accelerate_folder_is_read_with_the_safe_unpickler(tmp_path):
    acc = Accelerator(cpu=True)
    run = build(acc)
    train(acc, run, 2)
    folder = str(tmp_path / "plain")
    acc.save_state(folder)  # Accelerate's own: no proof to check the files against
    data, marker = _payload(tmp_path)
    with open(os.path.join(folder, "custom_checkpoint_0.pkl"), "wb") as f:
        f.write(data)
    sa.enable(acc)
    with pytest.raises(UnsafeCheckpointError):
        acc.load_state(folder)
    assert not os.path.exists(marker)


def test_a_user_class_loads_once_allow_listed(tmp_path):
    acc = Accelerator(cpu=True)
    run = build(acc)
    holder = Holder(HParams(0.5, "warm"))
    acc.register_for_checkpointing(holder)
    sa.enable(acc)
    train(acc, run, 2)
    folder = str(tmp_path / "ck")
    acc.save_state(folder)
    before = snapshot(acc, run)
    holder.value = None
    with pytest.raises(UnsafeCheckpointError) as err:
        acc.load_state(folder)
    assert "HParams" in str(err.value) and "allow_globals" in str(err.value)
    stagesave.allow_globals(HParams)  # process-wide; HParams belongs to this test only
    train(acc, run, 2)
    acc.load_state(folder)
    assert holder.value == HParams(0.5, "warm")
    assert_same(before, snapshot(acc, run))


@pytest.mark.parametrize("how", ["argument", "environment", "side-file"])
def test_trusted_loads_a_user_class_without_an_allow_list(tmp_path, monkeypatch, how):
    options: dict[str, Any] = {}
    if how == "argument":
        options["trusted"] = True
    elif how == "environment":
        monkeypatch.setenv("STAGESAVE_ACCELERATE_TRUSTED", "1")
    else:
        side = tmp_path / "stagesave.yaml"
        side.write_text("trusted: true\n")
        monkeypatch.setenv("STAGESAVE_ACCELERATE_CONFIG", str(side))
    acc = Accelerator(cpu=True)
    holder = Holder(Schedule(7))
    acc.register_for_checkpointing(holder)
    ckpt = sa.enable(acc, **options)
    assert ckpt.options.trusted is True
    folder = str(tmp_path / "ck")
    acc.save_state(folder)
    holder.value = None
    acc.load_state(folder)
    assert holder.value == Schedule(7)


def test_trusted_still_refuses_unlisted_files(tmp_path):
    acc, run, folder, before = _saved(tmp_path, trusted=True, verify_on_load=False)
    data, marker = _payload(tmp_path)
    acc.register_for_checkpointing(type(run["counters"][0])())
    with open(os.path.join(folder, "custom_checkpoint_2.pkl"), "wb") as f:
        f.write(data)
    with pytest.raises(IntegrityError):
        acc.load_state(folder)
    assert not os.path.exists(marker)
    _assert_not_restored(acc, run, before)


def test_round_trip_is_bitwise_and_never_unpickles_unsafely(tmp_path, monkeypatch):
    calls: list[Any] = []
    real = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        # safe: torch's weights_only unpickler, or stagesave's own unpickler as pickle_module
        module = kwargs.get("pickle_module")
        calls.append(
            kwargs.get("weights_only") is True or (module is not None and module is not pickle)
        )
        return real(*args, **kwargs)

    acc, run, folder, before = _saved(tmp_path)
    monkeypatch.setattr(torch, "load", spy)
    acc.load_state(folder)
    assert_same(before, snapshot(acc, run))
    assert calls and all(calls), calls


def test_a_reproved_pickle_is_refused_under_automatic_naming(tmp_path):
    from accelerate.utils import ProjectConfiguration

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    run = build(acc)
    sa.enable(acc)
    train(acc, run, 2)
    acc.save_state()
    sa.enabled(acc).wait()
    folder = str(tmp_path / "checkpoints" / "checkpoint_0")
    data, marker = _payload(tmp_path)
    _reprove(folder, "custom_checkpoint_0.pkl", data)
    with pytest.raises(UnsafeCheckpointError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc.load_state()
    assert not os.path.exists(marker)
    shutil.rmtree(folder)
