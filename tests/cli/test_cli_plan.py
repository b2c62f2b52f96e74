"""`stagesave plan`: the seed's figures, the formulas against hand-computed values, parsing."""

from __future__ import annotations

import math

import pytest

# the formulas and parsers behind `stagesave plan`, checked against hand-computed values
from stagesave.cli._plan import bytes_per_param, daly_interval, plan, young_interval
from stagesave.cli._units import (
    fmt_bytes,
    fmt_duration,
    parse_count,
    parse_duration,
    parse_rate,
    parse_size,
)


def test_seed_figures_70b(cli):
    r = cli("plan", "70B", "--json")
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["params"] == 70e9
    assert doc["weights_bytes"] == 140e9  # 2 B/param of 16-bit weights
    assert doc["bytes_per_param"] == 16
    assert doc["breakdown"] == {
        "weights": 2,
        "gradients": 2,
        "master_weights": 4,
        "optimizer_state": 8,
    }
    assert doc["checkpoint_bytes"] == pytest.approx(1.12e12)  # 1.12 TB training state


def test_seed_figures_70b_text(cli):
    r = cli("plan", "70B")
    assert r.code == 0
    assert "140 GB" in r.out and "1.12 TB" in r.out and "70B" in r.out


def test_weights_only_is_140gb(cli):
    doc = cli("plan", "70B", "--optimizer", "none", "--json").json()
    assert doc["checkpoint_bytes"] == 140e9 and doc["bytes_per_param"] == 2


def test_seed_figures_400b(cli):
    doc = cli("plan", "400B", "--json").json()
    assert doc["checkpoint_bytes"] == pytest.approx(6.4e12)
    assert doc["checkpoint_bytes"] >= 6.4e12 * (1 - 1e-12)
    # sharding splits the write among GPUs, the total is unchanged
    doc512 = cli("plan", "400B", "--gpus", "512", "--json").json()
    assert doc512["checkpoint_bytes"] == doc["checkpoint_bytes"]
    assert doc512["per_gpu_bytes"] == pytest.approx(6.4e12 / 512)


def test_seed_5tb_at_10gbps_hourly(cli):
    doc = cli(
        "plan", "--size", "5TB", "--storage-bw", "10GB/s", "--interval", "1h", "--json"
    ).json()
    assert doc["sync_save_s"] == pytest.approx(500.0)
    assert doc["sync_save_s"] / 60 == pytest.approx(8.333, abs=1e-3)  # ≈ 8.3 min
    assert 0.13 <= doc["sync_lost_fraction"] <= 0.14  # ~13-14% of an hour
    assert doc["sync_lost_fraction"] == pytest.approx(500 / 3600)
    text = cli("plan", "--size", "5TB").out
    assert "8.33 min" in text and "13.9%" in text


def test_staging_and_async_loss_hand_computed():
    r = plan(
        checkpoint_bytes=1.12e12,
        gpus=64,
        storage_bytes_per_s=10e9,
        d2h_bytes_per_s=20e9,
        interval_s=1800,
    )
    assert r.per_gpu_bytes == pytest.approx(17.5e9)
    assert r.staging_blocking_s == pytest.approx(0.875)  # 17.5 GB / 20 GB/s
    assert r.sync_save_s == pytest.approx(112.0)
    assert r.async_lost_fraction == pytest.approx(0.875 / 1800)
    assert r.sync_lost_fraction == pytest.approx(112 / 1800)
    assert r.sustained_bytes_per_s_needed == pytest.approx(1.12e12 / 1800)
    assert r.background_write_fits_interval


def test_async_overrun_when_the_write_is_longer_than_the_interval():
    r = plan(
        checkpoint_bytes=5e12,
        gpus=8,
        storage_bytes_per_s=1e9,
        d2h_bytes_per_s=25e9,
        interval_s=3600,
    )
    # 5000 s of writing in a 3600 s interval: the next save waits 1400 s for the buffer
    assert r.async_blocking_s == pytest.approx(25.0 + 1400.0)
    assert not r.background_write_fits_interval


def test_young_and_daly_hand_computed():
    # delta = 500 s, M = 24 h: Young = sqrt(2 * 500 * 86400) = sqrt(86 400 000)
    assert young_interval(500, 86400) == pytest.approx(9295.160030897801)
    # Daly: x = 500 / 172800; sqrt(2dM) (1 + sqrt(x)/3 + x/9) - d
    x = 500 / 172800
    assert daly_interval(500, 86400) == pytest.approx(
        9295.160030897801 * (1 + math.sqrt(x) / 3 + x / 9) - 500
    )
    assert daly_interval(500, 86400) == pytest.approx(8964.8, abs=0.1)
    # cost beyond twice the MTBF: Daly says checkpoint every MTBF
    assert daly_interval(300, 100) == 100


def test_plan_with_mtbf_reports_both_formulas(cli):
    doc = cli("plan", "--size", "5TB", "--mtbf", "24h", "--json").json()
    assert doc["young_interval_sync_s"] == pytest.approx(9295.16, abs=0.01)
    assert doc["daly_interval_sync_s"] == pytest.approx(8964.8, abs=0.1)
    staged = doc["async_blocking_s"]
    assert doc["young_interval_async_s"] == pytest.approx(math.sqrt(2 * staged * 86400))
    assert doc["expected_waste_sync"] == pytest.approx(500 / 3600 + 3600 / (2 * 86400))
    assert "Young" in cli("plan", "--size", "5TB", "--mtbf", "24h").out


@pytest.mark.parametrize(
    ("precision", "optimizer", "grads", "expected"),
    [
        ("bf16", "adam", True, 16),
        ("bf16", "adam", False, 14),
        ("fp32", "adam", True, 16),
        ("bf16", "none", True, 2),
        ("fp32", "sgd", True, 8),
        ("bf16", "momentum", True, 12),
        ("fp8", "none", True, 1),
    ],
)
def test_bytes_per_param(precision, optimizer, grads, expected):
    assert sum(bytes_per_param(precision, optimizer, gradients=grads).values()) == expected


def test_units():
    assert (
        parse_count("70B") == 70e9
        and parse_count("350m") == 350e6
        and parse_count("1.5T") == 1.5e12
    )
    assert parse_count("7e9") == 7e9
    assert (
        parse_size("5TB") == 5e12
        and parse_size("512MiB") == 512 * 2**20
        and parse_size("1.12 TB") == 1.12e12
    )
    assert parse_rate("10GB/s") == 10e9 and parse_rate("800MiB/s") == 800 * 2**20
    assert (
        parse_duration("1h") == 3600
        and parse_duration("30min") == 1800
        and parse_duration("90") == 90
    )
    assert parse_duration("2d") == 172800
    assert (
        fmt_bytes(1.12e12) == "1.12 TB"
        and fmt_bytes(140e9) == "140 GB"
        and fmt_bytes(6.4e12) == "6.4 TB"
    )
    assert fmt_duration(500) == "8.33 min" and fmt_duration(0.012) == "12 ms"
    for bad, fn in (
        ("ten", parse_count),
        ("5XB", parse_size),
        ("0", parse_duration),
        ("-1GB/s", parse_rate),
    ):
        with pytest.raises(ValueError):
            fn(bad)


def test_bad_arguments_exit_2_with_one_line(cli):
    r = cli("plan", "seventy")
    assert r.code == 2
    assert r.err.startswith("stagesave: error: cannot read parameter count 'seventy'")
    assert r.err.count("\n") == 1 and "Traceback" not in r.err
    r = cli("plan")
    assert r.code == 2 and "give a parameter count" in r.err
    r = cli("plan", "70B", "--interval", "soon")
    assert r.code == 2 and "duration" in r.err
