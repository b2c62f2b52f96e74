"""``stagesave report ROOT``: what the saves of a run cost, from their telemetry JSON lines.

``Checkpointer(telemetry_jsonl=True)`` appends one JSON object per save to
``stagesave-telemetry.jsonl`` beside local checkpoints. The report summarizes training stall per
save, write throughput and time to commit, and draws a timeline: for each save, the staging copy
(the only part training waits for), the background write and the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from ..errors import CheckpointNotFoundError
from ..ondisk.names import TELEMETRY_FILE
from ..stores.targets import is_url
from ._common import CliError, Env, literal
from ._units import fmt_bytes, fmt_duration, fmt_rate

__all__ = ["Summary", "add_parser", "draw_timeline", "read_telemetry", "run", "summarize"]

#: Largest telemetry file we read (a line is ~600 bytes: this is over a million saves).
MAX_TELEMETRY_BYTES = 1 << 30


def _source(env: Env, path: str) -> tuple[str, bytes]:
    if is_url(path):
        import fsspec

        url = path if path.endswith(".jsonl") else f"{path.rstrip('/')}/{TELEMETRY_FILE}"
        try:
            with fsspec.open(url, "rb", **env.storage_options) as f:
                return url, f.read(MAX_TELEMETRY_BYTES + 1)
        except FileNotFoundError as exc:
            raise CheckpointNotFoundError(f"no telemetry at {url}") from exc
    local = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(local):
        local = os.path.join(local, TELEMETRY_FILE)
        if not os.path.exists(local):
            raise CheckpointNotFoundError(
                f"no {TELEMETRY_FILE} in {os.path.dirname(local)}: save with "
                "Checkpointer(telemetry_jsonl=True) to record it"
            )
    if not os.path.exists(local):
        raise CheckpointNotFoundError(f"no such file or folder: {local}")
    with open(local, "rb") as f:
        return local, f.read(MAX_TELEMETRY_BYTES + 1)


def read_telemetry(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The saves recorded in JSON lines, oldest first, and the number of unreadable lines.

    Raises:
        CliError: the file is over the size limit.
    """
    if len(data) > MAX_TELEMETRY_BYTES:
        raise CliError(
            f"the telemetry file is over {fmt_bytes(MAX_TELEMETRY_BYTES)}; split it first"
        )
    saves, bad = [], 0
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            bad += 1  # a line torn by a crash while appending
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("started_at"), (int, float)):
            bad += 1
            continue
        saves.append(doc)
    saves.sort(key=lambda d: d["started_at"])
    return saves, bad


def _num(d: dict[str, Any], key: str) -> float:
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


@dataclass
class Summary:
    saves: int
    failed: int
    bytes_total: float
    stall_mean_s: float
    stall_median_s: float
    stall_p95_s: float
    stall_max_s: float
    throughput_median: float
    commit_median_s: float
    commit_max_s: float
    span_s: float
    stalled_fraction: float


def summarize(saves: list[dict[str, Any]]) -> Summary:
    """Stall, throughput and time to commit over the recorded saves.

    Raises:
        CliError: no saves.
    """
    if not saves:
        raise CliError("the telemetry file records no saves")
    ok = [s for s in saves if not s.get("error")]
    stalls = [_num(s, "blocking_s") for s in saves]
    rates = [_num(s, "throughput_bytes_per_s") for s in ok if _num(s, "throughput_bytes_per_s") > 0]
    commits = [_num(s, "time_to_commit_s") for s in ok] or [0.0]
    start = min(_num(s, "started_at") for s in saves)
    end = max(
        max(_num(s, "committed_at"), _num(s, "started_at") + _num(s, "blocking_s")) for s in saves
    )
    span = max(end - start, 1e-9)
    return Summary(
        saves=len(saves),
        failed=len(saves) - len(ok),
        bytes_total=sum(_num(s, "bytes") for s in ok),
        stall_mean_s=statistics.fmean(stalls),
        stall_median_s=statistics.median(stalls),
        stall_p95_s=_pct(stalls, 0.95),
        stall_max_s=max(stalls),
        throughput_median=statistics.median(rates) if rates else 0.0,
        commit_median_s=statistics.median(commits),
        commit_max_s=max(commits),
        span_s=span,
        stalled_fraction=min(1.0, sum(stalls) / span),
    )


def draw_timeline(saves: list[dict[str, Any]], png: str) -> None:
    """A PNG: one row per save, staging vs background write vs commit, seconds since the first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = min(_num(s, "started_at") for s in saves)
    height = min(2.0 + 0.3 * len(saves), 40.0)
    fig, ax = plt.subplots(figsize=(10, height))
    colors = {"staging": "#d62728", "write": "#1f77b4", "commit": "#2ca02c"}
    for i, s in enumerate(saves):
        start = _num(s, "started_at") - t0
        ax.broken_barh(
            [(start, max(_num(s, "blocking_s"), 1e-6))], (i - 0.4, 0.8), color=colors["staging"]
        )
        committed = _num(s, "committed_at")
        if committed > 0:
            end = committed - t0
            commit = _num(s, "commit_s")
            write = _num(s, "write_s")
            ax.broken_barh(
                [(end - commit - write, max(write, 1e-6))], (i - 0.4, 0.8), color=colors["write"]
            )
            ax.broken_barh(
                [(end - commit, max(commit, 1e-6))], (i - 0.4, 0.8), color=colors["commit"]
            )
        elif s.get("error"):
            ax.plot([start + _num(s, "blocking_s")], [i], marker="x", color="black", markersize=9)
    ax.set_yticks(range(len(saves)))
    ax.set_yticklabels(
        [os.path.basename(str(s.get("path", "?"))) or "?" for s in saves], fontsize=8
    )
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first save")
    ax.set_title("stagesave: where each save's time went (training waits only for staging)")
    ax.legend(
        handles=[Patch(color=colors["staging"], label="staging (blocks training)"),
                 Patch(color=colors["write"], label="background write"),
                 Patch(color=colors["commit"], label="commit")],
        loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, frameon=False, fontsize=8,
    )
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="summarize save telemetry (stall, throughput, time to commit) and draw a PNG timeline",
        description=f"Read {TELEMETRY_FILE} in ROOT (written by "
        "Checkpointer(telemetry_jsonl=True)), or a telemetry file given directly, print a summary "
        "and write a PNG timeline.",
    )
    p.add_argument("root", metavar="ROOT|FILE.jsonl")
    p.add_argument(
        "--png",
        default="stagesave-timeline.png",
        help="where to write the timeline (default ./stagesave-timeline.png)",
    )
    p.add_argument("--no-png", action="store_true", help="do not draw the timeline")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(env: Env, args: argparse.Namespace) -> int:
    where, data = _source(env, args.root)
    records, bad = read_telemetry(data)
    # Uploads to a remote tier (TieredStore) never block training: counted, not mixed in.
    saves = [r for r in records if r.get("tier") != "remote"]
    uploads = [r for r in records if r.get("tier") == "remote"]
    if not saves:
        raise CliError(f"{where} records no saves" + (f" ({bad} unreadable lines)" if bad else ""))
    summary = summarize(saves)
    if not args.no_png:
        draw_timeline(saves, args.png)
    if args.json:
        env.print_json(
            {
                "source": where,
                "unreadable_lines": bad,
                "png": None if args.no_png else args.png,
                "remote_uploads": len(uploads),
                **vars(summary),
            }
        )
        return 0
    t = Table(
        title=literal(f"{summary.saves} saves in {where}"),
        title_justify="left",
        show_header=False,
        box=None,
    )
    t.add_column("what")
    t.add_column("value", justify="right")
    rows = [
        ("failed saves", str(summary.failed)),
        ("bytes written", fmt_bytes(summary.bytes_total)),
        (
            "training stall per save",
            (f"median {fmt_duration(summary.stall_median_s)}, p95 "
             f"{fmt_duration(summary.stall_p95_s)}, max {fmt_duration(summary.stall_max_s)}"),
        ),
        ("write throughput (median)", fmt_rate(summary.throughput_median)),
        (
            "time to commit",
            (f"median {fmt_duration(summary.commit_median_s)}, max "
             f"{fmt_duration(summary.commit_max_s)}"),
        ),
        (
            "stalled / wall time",
            f"{100 * summary.stalled_fraction:.3g}% of {fmt_duration(summary.span_s)}",
        ),
    ]
    if uploads:
        failed = sum(1 for u in uploads if u.get("error"))
        times = [_num(u, "time_to_commit_s") for u in uploads if not u.get("error")] or [0.0]
        rows.append(
            (
                "uploads to the remote tier",
                (f"{len(uploads)} ({failed} failed), median "
                 f"{fmt_duration(statistics.median(times))}"),
            )
        )
    for k, v in rows:
        t.add_row(k, v)
    env.out.print(t)
    if bad:
        env.say(f"{bad} unreadable lines skipped (torn by a crash while appending?)")
    if not args.no_png:
        env.say(f"timeline: {args.png}")
    return 0
