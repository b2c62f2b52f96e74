"""``stagesave plan``: the arithmetic of checkpoint bursts, before a run.

What a checkpoint weighs is bytes per parameter times parameters: 2 B for 16-bit weights alone,
16 B for an unsharded mixed-precision Adam training state (16-bit weights and gradients, fp32
master weights, two fp32 moments), so 1.12 TB for 70B parameters and over 6.4 TB for 400B.
Sharding (FSDP, ZeRO-3) splits the writing among GPUs but not the total. A synchronous save
stops training for size / storage bandwidth (5 TB at 10 GB/s: 500 s, 8.3 min, ~13.9% of an hour
when saving hourly); staging first stops it only for each GPU's share / device-to-host
bandwidth. The optimal interval trades that cost against the work lost to failures: Young's
first-order sqrt(2 delta M) and Daly's higher-order refinement (J. W. Young, CACM 1974;
J. T. Daly, FGCS 2006).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from typing import Any

from rich.table import Table

from ._common import CliError, Env
from ._units import (
    fmt_bytes,
    fmt_count,
    fmt_duration,
    fmt_rate,
    parse_count,
    parse_duration,
    parse_rate,
    parse_size,
)

__all__ = ["PlanResult", "bytes_per_param", "daly_interval", "plan", "young_interval"]

#: Bytes of one value in each training precision.
PRECISION_BYTES = {"fp8": 1, "fp16": 2, "bf16": 2, "fp32": 4, "fp64": 8}
#: fp32 values an optimizer keeps per parameter.
OPTIMIZER_STATES = {"none": 0, "sgd": 0, "momentum": 1, "lion": 1, "adam": 2, "adamw": 2}

DEFAULT_STORAGE_BW = 10e9
DEFAULT_D2H_BW = 25e9  # PCIe 4.0 x16, per GPU, as achieved (not the 32 GB/s line rate)
DEFAULT_GPUS = 8
DEFAULT_INTERVAL_S = 3600.0


def bytes_per_param(precision: str, optimizer: str, *, gradients: bool = True) -> dict[str, int]:
    """Bytes per parameter, by component, of a training state.

    Weights in ``precision``; with an optimizer, gradients in ``precision`` (unless
    ``gradients=False``), fp32 master weights when ``precision`` is narrower than fp32, and
    the optimizer's fp32 states. ``bf16`` + ``adam`` gives 2 + 2 + 4 + 8 = 16.

    Raises:
        ValueError: unknown precision or optimizer.
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(
            f"unknown precision {precision!r}; choose one of {sorted(PRECISION_BYTES)}"
        )
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; choose one of {sorted(OPTIMIZER_STATES)}"
        )
    p = PRECISION_BYTES[precision]
    out = {"weights": p}
    if optimizer != "none":
        out["gradients"] = p if gradients else 0
        out["master_weights"] = 4 if p < 4 else 0
        out["optimizer_state"] = 4 * OPTIMIZER_STATES[optimizer]
    return out


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval, sqrt(2 * cost * MTBF)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal interval (compute time between checkpoints).

    sqrt(2 d M) * (1 + sqrt(d / 2M) / 3 + (d / 2M) / 9) - d for d < 2M, else M.
    """
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


@dataclass
class PlanResult:
    """Every figure ``plan`` prints (bytes, seconds, fractions)."""

    params: float | None
    bytes_per_param: float | None
    breakdown: dict[str, int] | None
    weights_bytes: float | None
    checkpoint_bytes: float
    gpus: int
    per_gpu_bytes: float
    storage_bytes_per_s: float
    d2h_bytes_per_s: float
    interval_s: float
    mtbf_s: float | None
    sync_save_s: float
    staging_blocking_s: float
    async_blocking_s: float
    sync_lost_fraction: float
    async_lost_fraction: float
    sustained_bytes_per_s_needed: float
    background_write_fits_interval: bool
    young_interval_sync_s: float | None = None
    daly_interval_sync_s: float | None = None
    young_interval_async_s: float | None = None
    daly_interval_async_s: float | None = None
    expected_waste_sync: float | None = None
    expected_waste_async: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(
    *,
    params: float | None = None,
    checkpoint_bytes: float | None = None,
    precision: str = "bf16",
    optimizer: str = "adam",
    gradients: bool = True,
    bytes_per_param_override: float | None = None,
    gpus: int = DEFAULT_GPUS,
    storage_bytes_per_s: float = DEFAULT_STORAGE_BW,
    d2h_bytes_per_s: float = DEFAULT_D2H_BW,
    interval_s: float = DEFAULT_INTERVAL_S,
    mtbf_s: float | None = None,
) -> PlanResult:
    """Checkpoint size, burst and time lost for one configuration.

    The synchronous save stops training for ``size / storage bandwidth``. The staged
    (asynchronous) save stops it for each GPU's share over the device-to-host bandwidth, plus
    whatever part of the background write does not fit in the interval (the next save then
    waits for it). Lost fractions are of wall-clock time between saves; with ``mtbf_s`` the
    expected waste adds the work lost to failures, ``T / 2M`` on average.

    Raises:
        ValueError: neither ``params`` nor ``checkpoint_bytes``, or a value out of range.
    """
    if gpus < 1:
        raise ValueError(f"the GPU count must be at least 1, got {gpus}")
    breakdown: dict[str, int] | None = None
    bpp: float | None = None
    weights: float | None = None
    if checkpoint_bytes is None:
        if params is None:
            raise ValueError("give a parameter count (e.g. 70B) or a checkpoint size (--size 5TB)")
        if bytes_per_param_override is not None:
            if bytes_per_param_override <= 0:
                raise ValueError(
                    f"bytes per parameter must be positive, got {bytes_per_param_override}"
                )
            bpp = bytes_per_param_override
        else:
            breakdown = bytes_per_param(precision, optimizer, gradients=gradients)
            bpp = float(sum(breakdown.values()))
        checkpoint_bytes = params * bpp
    if params is not None:
        weights = params * PRECISION_BYTES.get(precision, 2)
    if checkpoint_bytes <= 0:
        raise ValueError("the checkpoint size must be positive")
    per_gpu = checkpoint_bytes / gpus
    sync_s = checkpoint_bytes / storage_bytes_per_s
    staging_s = per_gpu / d2h_bytes_per_s
    async_s = staging_s + max(0.0, sync_s - interval_s)
    result = PlanResult(
        params=params,
        bytes_per_param=bpp,
        breakdown=breakdown,
        weights_bytes=weights,
        checkpoint_bytes=checkpoint_bytes,
        gpus=gpus,
        per_gpu_bytes=per_gpu,
        storage_bytes_per_s=storage_bytes_per_s,
        d2h_bytes_per_s=d2h_bytes_per_s,
        interval_s=interval_s,
        mtbf_s=mtbf_s,
        sync_save_s=sync_s,
        staging_blocking_s=staging_s,
        async_blocking_s=async_s,
        sync_lost_fraction=min(1.0, sync_s / interval_s),
        async_lost_fraction=min(1.0, async_s / interval_s),
        sustained_bytes_per_s_needed=checkpoint_bytes / interval_s,
        background_write_fits_interval=sync_s <= interval_s,
    )
    if mtbf_s is not None:
        result.young_interval_sync_s = young_interval(sync_s, mtbf_s)
        result.daly_interval_sync_s = daly_interval(sync_s, mtbf_s)
        result.young_interval_async_s = young_interval(async_s, mtbf_s)
        result.daly_interval_async_s = daly_interval(async_s, mtbf_s)
        result.expected_waste_sync = min(1.0, sync_s / interval_s + interval_s / (2 * mtbf_s))
        result.expected_waste_async = min(1.0, async_s / interval_s + interval_s / (2 * mtbf_s))
    return result


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def render(env: Env, r: PlanResult) -> None:
    """Print a plan as a table."""
    t = Table(title="checkpoint plan", show_header=True, header_style="bold", title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("how", style="dim")
    if r.params is not None:
        t.add_row("parameters", fmt_count(r.params), "")
    if r.weights_bytes is not None:
        t.add_row("weights alone", fmt_bytes(r.weights_bytes), "parameters x weight precision")
    if r.bytes_per_param is not None:
        how = " + ".join(f"{v} {k.replace('_', ' ')}" for k, v in (r.breakdown or {}).items() if v)
        t.add_row("bytes per parameter", f"{r.bytes_per_param:g} B", how or "given")
    t.add_row("checkpoint size", fmt_bytes(r.checkpoint_bytes), "the write burst of every save")
    t.add_row(
        "per-GPU share",
        fmt_bytes(r.per_gpu_bytes),
        f"over {r.gpus} GPUs (sharding splits, never shrinks)",
    )
    t.add_row(
        "synchronous save",
        fmt_duration(r.sync_save_s),
        f"size / {fmt_rate(r.storage_bytes_per_s)} storage",
    )
    t.add_row(
        "blocking with staging",
        fmt_duration(r.staging_blocking_s),
        f"share / {fmt_rate(r.d2h_bytes_per_s)} device-to-host",
    )
    t.add_row("save interval", fmt_duration(r.interval_s), "")
    t.add_row("lost, synchronous", _pct(r.sync_lost_fraction), "save time / interval")
    note = (
        "staging / interval"
        if r.background_write_fits_interval
        else "staging + write overrun / interval"
    )
    t.add_row("lost, staged (async)", _pct(r.async_lost_fraction), note)
    t.add_row("bandwidth to keep up", fmt_rate(r.sustained_bytes_per_s_needed), "size / interval")
    if r.mtbf_s is not None:
        assert r.young_interval_sync_s is not None and r.daly_interval_sync_s is not None
        assert r.young_interval_async_s is not None and r.daly_interval_async_s is not None
        assert r.expected_waste_sync is not None and r.expected_waste_async is not None
        t.add_row("MTBF", fmt_duration(r.mtbf_s), "")
        t.add_row(
            "optimal interval, sync",
            f"{fmt_duration(r.young_interval_sync_s)} / {fmt_duration(r.daly_interval_sync_s)}",
            "Young sqrt(2dM) / Daly",
        )
        t.add_row(
            "optimal interval, async",
            f"{fmt_duration(r.young_interval_async_s)} / {fmt_duration(r.daly_interval_async_s)}",
            "Young sqrt(2dM) / Daly",
        )
        t.add_row(
            "expected waste, sync", _pct(r.expected_waste_sync), "d/T + T/2M at this interval"
        )
        t.add_row(
            "expected waste, async", _pct(r.expected_waste_async), "d/T + T/2M at this interval"
        )
    env.out.print(t)
    if not r.background_write_fits_interval:
        env.out.print(
            f"warning: one save takes {fmt_duration(r.sync_save_s)} to write, longer than the "
            f"{fmt_duration(r.interval_s)} interval: saves will queue; lengthen the interval or "
            "add bandwidth."
        )


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="checkpoint size, write burst, time lost and optimal interval for a model",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("params", nargs="?", help="parameter count: 70B, 405B, 350M, 7e9")
    p.add_argument("--size", help="checkpoint size instead of a parameter count: 5TB, 800GiB")
    p.add_argument(
        "--precision",
        default="bf16",
        choices=sorted(PRECISION_BYTES),
        help="weight precision (default bf16)",
    )
    p.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZER_STATES),
                   help="optimizer whose state is saved; 'none' for weights only (default adam)")
    p.add_argument("--no-gradients", action="store_true", help="the checkpoint holds no gradients")
    p.add_argument("--bytes-per-param", type=float, help="override the per-parameter size")
    p.add_argument(
        "--gpus",
        type=int,
        default=DEFAULT_GPUS,
        help=f"GPUs sharing the save (default {DEFAULT_GPUS})",
    )
    p.add_argument(
        "--storage-bw",
        default="10GB/s",
        help="aggregate write bandwidth to storage (default 10GB/s)",
    )
    p.add_argument("--d2h-bw", "--h2d-bw", dest="d2h_bw", default="25GB/s",
                   help="device-to-host copy bandwidth per GPU (default 25GB/s, PCIe 4.0 x16)")
    p.add_argument("--interval", default="1h", help="time between checkpoints (default 1h)")
    p.add_argument(
        "--mtbf", help="mean time between failures of the whole job, e.g. 24h: adds Young/Daly"
    )
    p.add_argument("--json", action="store_true", help="print JSON (bytes, seconds, fractions)")
    p.set_defaults(func=run)


def run(env: Env, args: argparse.Namespace) -> int:
    try:
        result = plan(
            params=parse_count(args.params) if args.params else None,
            checkpoint_bytes=parse_size(args.size) if args.size else None,
            precision=args.precision,
            optimizer=args.optimizer,
            gradients=not args.no_gradients,
            bytes_per_param_override=args.bytes_per_param,
            gpus=args.gpus,
            storage_bytes_per_s=parse_rate(args.storage_bw),
            d2h_bytes_per_s=parse_rate(args.d2h_bw),
            interval_s=parse_duration(args.interval),
            mtbf_s=parse_duration(args.mtbf) if args.mtbf else None,
        )
    except ValueError as exc:
        raise CliError(str(exc), 2) from exc
    if args.json:
        env.print_json(result.to_dict())
    else:
        render(env, result)
    return 0
