"""Turning the adapter on and off: what enable() patches, disable() restores, the environment
and side-file configuration, and the synchronous fallback for FSDP/DeepSpeed."""

from __future__ import annotations

import os
import warnings

import pytest
import stagesave.accelerate as sa
from accelerate import Accelerator
from accelerate.utils import DistributedType

# private: the precedence of sources needs an explicit environ, which enable() does not take
from stagesave.accelerate._config import resolve_options


def test_enable_patches_exactly_five_instance_methods_and_disable_restores_them(tmp_path):
    acc = Accelerator(cpu=True)
    other = Accelerator(cpu=True)
    before = set(vars(acc))
    ckpt = sa.enable(acc)
    installed = {"save_state", "load_state", "end_training", "free_memory", "clear"}
    assert set(vars(acc)) - before == {*installed, "_stagesave"}
    for name in installed:  # each keeps the name and docstring of Accelerate's method it shadows
        assert (
            getattr(acc, name).__name__ == name
            and getattr(acc, name).__doc__ == getattr(Accelerator, name).__doc__
        )
    assert sa.enabled(acc) is ckpt and sa.enable(acc) is ckpt  # idempotent
    assert "save_state" not in vars(other)  # the class and other instances are untouched
    assert sa.enable(acc, max_pending=2) is ckpt  # the options it already has
    # other options before anything went through it (e.g. enabled by the runner, then by the
    # script): the options given last win
    replaced = sa.enable(acc, max_pending=1)
    assert (
        replaced is not ckpt and sa.enabled(acc) is replaced and replaced.options.max_pending == 1
    )
    acc.save_state(str(tmp_path / "ck"))
    with pytest.raises(
        ValueError,
        match="already called on this Accelerator with other options, and it has "
        "saved or loaded since",
    ):
        sa.enable(acc, max_pending=2)
    sa.disable(acc)
    assert set(vars(acc)) == before
    for name in installed:
        assert getattr(acc, name).__func__ is getattr(Accelerator, name)
    assert sa.enabled(acc) is None
    sa.disable(acc)  # a second disable is a no-op


def test_switched_off_by_environment_leaves_accelerate_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("STAGESAVE_ACCELERATE", "0")
    acc = Accelerator(cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # switching off is deliberate: no warning
        ckpt = sa.enable(acc)
    assert not ckpt.asynchronous and "save_state" not in vars(acc)
    assert ckpt.save_state(str(tmp_path / "ck")) is None  # Accelerate's own save ran
    assert (tmp_path / "ck" / "random_states_0.pkl").exists()
    import stagesave

    # Accelerate's files, no stagesave proof
    assert stagesave.verify(tmp_path / "ck").status == "unverified"
    monkeypatch.setenv("STAGESAVE_ACCELERATE", "maybe")
    with pytest.raises(ValueError, match="STAGESAVE_ACCELERATE='maybe' is not understood"):
        sa.enable(Accelerator(cpu=True))


def test_options_precedence_code_then_environment_then_side_file(tmp_path):
    side = tmp_path / "stagesave.yaml"
    side.write_text("stagesave:\n  max_pending: 3\n  checksum: blake3\n  destination: s3://bucket/run\n"
                    "  storage_options: {endpoint_url: 'http://127.0.0.1:9000'}\n")
    env = {
        "STAGESAVE_ACCELERATE_CONFIG": str(side),
        "STAGESAVE_ACCELERATE_MAX_PENDING": "1",
        "STAGESAVE_ACCELERATE_VERIFY_ON_LOAD": "false",
        "STAGESAVE_ACCELERATE_LOCAL_TIER": "~/nvme",
        "STAGESAVE_ACCELERATE_KEEP_LOCAL": "2",
    }
    o = resolve_options({"io_threads": 2}, env)
    assert (o.max_pending, o.checksum, o.destination, o.verify_on_load, o.io_threads) == (
        1,
        "blake3",
        "s3://bucket/run",
        False,
        2,
    )
    assert (o.local_tier, o.keep_local) == (os.path.expanduser("~/nvme"), 2)
    assert o.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    assert resolve_options({"max_pending": 4}, env).max_pending == 4
    assert resolve_options({}, {}) == sa.Options()


def test_device_staging_from_the_environment_reaches_the_checkpointer(tmp_path):
    assert resolve_options({}, {}).device_staging is False
    assert (
        resolve_options({}, {"STAGESAVE_ACCELERATE_DEVICE_STAGING": "yes"}).device_staging is True
    )
    with pytest.raises(
        ValueError,
        match="STAGESAVE_ACCELERATE_DEVICE_STAGING: device_staging must be true or false",
    ):
        resolve_options({}, {"STAGESAVE_ACCELERATE_DEVICE_STAGING": "gpu"})
    acc = Accelerator(cpu=True, project_dir=str(tmp_path))
    ckpt = sa.AcceleratorCheckpointer(acc, device_staging=True)
    # private: the core Checkpointer behind the adapter is where the option has to arrive
    assert ckpt._checkpointer().device_staging is True  # host state: staged in host memory anyway
    ckpt.close()


def test_sync_outside_training_and_telemetry_from_the_environment_and_side_file(tmp_path):
    assert resolve_options({}, {}).sync_outside_training is True
    assert resolve_options({}, {}).telemetry_jsonl is False
    env = {
        "STAGESAVE_ACCELERATE_SYNC_OUTSIDE_TRAINING": "off",
        "STAGESAVE_ACCELERATE_TELEMETRY_JSONL": "yes",
    }
    o = resolve_options({}, env)
    assert (o.sync_outside_training, o.telemetry_jsonl) == (False, True)
    side = tmp_path / "stagesave.yaml"
    side.write_text("sync_outside_training: false\ntelemetry_jsonl: ~/runs/t.jsonl\n")
    o = resolve_options({}, {"STAGESAVE_ACCELERATE_CONFIG": str(side)})
    assert (o.sync_outside_training, o.telemetry_jsonl) == (
        False,
        os.path.expanduser("~/runs/t.jsonl"),
    )
    with pytest.raises(
        ValueError,
        match="STAGESAVE_ACCELERATE_SYNC_OUTSIDE_TRAINING: sync_outside_training must be "
        "true or false, got 'sometimes'",
    ):
        resolve_options({}, {"STAGESAVE_ACCELERATE_SYNC_OUTSIDE_TRAINING": "sometimes"})
    # True names <project_dir>/stagesave-telemetry.jsonl: an Accelerator without one is told so
    with pytest.raises(
        ValueError,
        match=r"telemetry_jsonl=True writes <project_dir>/stagesave-telemetry.jsonl, "
        "and this Accelerator has no project_dir",
    ):
        sa.AcceleratorCheckpointer(Accelerator(cpu=True), telemetry_jsonl=True)


def test_bad_configuration_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_pendng: 2\n")
    with pytest.raises(ValueError, match=r"bad.yaml has unknown keys \['max_pendng'\]"):
        resolve_options({}, {"STAGESAVE_ACCELERATE_CONFIG": str(bad)})
    with pytest.raises(
        FileNotFoundError, match=r"STAGESAVE_ACCELERATE_CONFIG names .*missing.yaml"
    ):
        resolve_options({}, {"STAGESAVE_ACCELERATE_CONFIG": str(tmp_path / "missing.yaml")})
    with pytest.raises(
        ValueError, match="STAGESAVE_ACCELERATE_MAX_PENDING: max_pending must be an integer"
    ):
        resolve_options({}, {"STAGESAVE_ACCELERATE_MAX_PENDING": "two"})
    with pytest.raises(
        ValueError, match="STAGESAVE_ACCELERATE_IO_THREADS: io_threads must be >= 1"
    ):
        resolve_options({}, {"STAGESAVE_ACCELERATE_IO_THREADS": "0"})
    with pytest.raises(TypeError, match=r"unknown stagesave.accelerate option 'keep_last'"):
        sa.enable(Accelerator(cpu=True), keep_last=2)
    with pytest.raises(
        ValueError, match="STAGESAVE_ACCELERATE_KEEP_LOCAL: keep_local must be >= 1"
    ):
        resolve_options({}, {"STAGESAVE_ACCELERATE_KEEP_LOCAL": "0"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"local_tier": "/nvme/run"},
            "local_tier is a fast tier in front of destination=, which is not set",
        ),
        ({"keep_local": 1}, "keep_local applies to local_tier, which is not set"),
        (
            {"destination": "s3://b/run", "local_tier": "memory://x"},
            "local_tier must be a local directory",
        ),
        (
            {"destination": "/shared/run", "local_tier": "/shared/run/"},
            "local_tier and destination are the same folder",
        ),
    ],
)
def test_tier_options_that_cannot_work_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        sa.AcceleratorCheckpointer(Accelerator(cpu=True), **options)


def _fsdp_plugin(state_dict_type):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)


@pytest.mark.parametrize(
    ("kind", "state_dict_type", "options", "message"),
    [
        (
            DistributedType.DEEPSPEED,
            None,
            {},
            "DEEPSPEED runs save model and optimizer shards through DEEPSPEED's own",
        ),
        (
            DistributedType.FSDP,
            "FULL_STATE_DICT",
            {},
            (
                "FSDP runs with state_dict_type=FULL_STATE_DICT save through Accelerate's own "
                "torch.save calls"
            ),
        ),
        (
            DistributedType.FSDP,
            "SHARDED_STATE_DICT",
            {"destination": "memory://x/run"},
            "URL destinations and local_tier are not supported with FSDP",
        ),
    ],
    ids=["deepspeed", "fsdp-full-state-dict", "fsdp-url-destination"],
)
def test_runs_stagesave_cannot_stage_keep_accelerate_methods_with_one_warning(
    kind, state_dict_type, options, message
):
    # DeepSpeed is not installed, so this sets the kind on the real, shared AcceleratorState
    # (Accelerate itself only picks FSDP/DeepSpeed on GPU back ends); FSDP runs that stagesave
    # does stage are tested with real FSDP2 on 2 CPU processes (test_fsdp.py).
    acc = Accelerator(cpu=True)
    acc.state.distributed_type = kind
    if state_dict_type is not None:
        acc.state.fsdp_plugin = _fsdp_plugin(state_dict_type)
    with pytest.warns(sa.SynchronousFallbackWarning) as record:
        ckpt = sa.enable(acc, **options)
    assert len(record) == 1
    assert message in str(record[0].message)
    assert "stay Accelerate's own synchronous methods" in str(record[0].message)
    assert not ckpt.asynchronous and "save_state" not in vars(acc) and "load_state" not in vars(acc)


def test_sharded_fsdp_is_staged_without_warning():
    acc = Accelerator(cpu=True)
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = _fsdp_plugin("SHARDED_STATE_DICT")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt = sa.enable(acc)
    assert ckpt.asynchronous and "save_state" in vars(acc)
    sa.disable(acc)


def test_runner_usage_and_class_patch_is_undone(tmp_path):
    from stagesave.accelerate.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    script = tmp_path / "train.py"
    report = tmp_path / "seen.json"
    script.write_text(
        "import json, sys\nfrom accelerate import Accelerator\nimport stagesave.accelerate as sa\n"
        "acc = Accelerator(cpu=True)\n"
        f"json.dump([__name__, sa.enabled(acc) is not None, sys.argv[1:]], open({str(report)!r}, "
        "'w'))\n"
    )
    original = Accelerator.__init__
    try:
        main([str(script), "--lr", "3"])
        import json

        assert json.loads(report.read_text()) == ["__main__", True, ["--lr", "3"]]
        assert Accelerator.__init__ is not original  # every new Accelerator gets enabled
        acc = Accelerator(cpu=True)
        assert sa.enabled(acc) is not None and "save_state" in vars(acc)
        sa.disable(acc)
    finally:
        sa.disable_globally()
    assert Accelerator.__init__ is original
    assert sa.enabled(Accelerator(cpu=True)) is None
