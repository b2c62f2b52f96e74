"""Summarize runs of ``scripts/upstream-tests.sh``: counts, failing ids, failure categories.

    python tests/upstream/summarize.py RUN_DIR [RUN_DIR ...] [--reference PLAIN_RUN]
        [--sync STAGED_SYNC_RUN] [--out FILE]

Each RUN_DIR holds ``meta.json`` (written by the script) and ``records.jsonl`` (written by the
``upstream_record`` plugin). Writes ``summary.json`` into each RUN_DIR and prints (or writes to
``--out``) one Markdown report: a table of the runs, then each run's non-passing tests grouped by
category,
each with the first line of its failure. With ``--reference`` (a plain run of the same suite),
each failure says whether it also fails without stagesave.

Categories of a failing test (the first one listed is its primary category):
    async          only with ``--sync RUN`` (the same stagesave run with every save, removal and
                   ``save_state`` waited for): the test's setup/call fails here but passes there,
                   i.e. it read, listed or loaded a file while a save or removal was still pending
                   (the FileNotFoundError / stale-listing family)
    sidecar        a ``*.stagesave.json`` manifest seen by the test (listings, globs, torch.load
                   of a manifest: "Unsupported operand 123")
    temp-file      a pending save's ``*.stagesave-tmp`` temporary seen in a listing
    staging-dir    a ``.stagesave-staging`` folder in a directory the test lists or removes
                   ("Directory not empty")
    mocked-save    the test mocks ``torch.save`` (to count saves); stagesave's planner calls it
    missing-file   FileNotFoundError / CheckpointNotFoundError / "No such file"
    zombie-thread  Lightning's fixture: "Test left zombie thread" (a teardown error)
    timeout        pytest-timeout
    other          anything else
Message categories are matched on the setup/call failure (and, for a staged run, on the same
test's failure in the sync run), then on the teardown failure; ``other`` only if none matched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from typing import Any

# (name, pattern, where): "E" matches the failure message and the traceback's "E   " lines only
# (source lines quoted in a traceback, such as "except FileNotFoundError:", do not count); "all"
# matches the whole traceback.
CATEGORIES: list[tuple[str, re.Pattern[str], str]] = [
    # a manifest's name: "<file>.<40-digit id>.stagesave.json" (Lightning's HPC name parsing
    # turns the id into a version number of 30+ digits)
    ("sidecar", re.compile(r"\.stagesave\.json|Unsupported operand 123|\d{30,}"), "E"),
    ("temp-file", re.compile(r"\.stagesave-tmp"), "E"),
    ("staging-dir", re.compile(r"\.stagesave-staging|Directory not empty"), "E"),
    ("mocked-save", re.compile(r"_plan_torch_file[\s\S]*not a ZIP archive"), "all"),
    ("missing-file",
     re.compile(r"FileNotFoundError|CheckpointNotFoundError|No such file or directory"), "E"),
    ("zombie-thread", re.compile(r"zombie thread"), "E"),
    ("timeout", re.compile(r"Timeout \(?>|Failed: Timeout"), "all"),
]
ORDER = ["async"] + [name for name, _, _ in CATEGORIES] + ["other"]
COUNT_KEYS = ["passed", "failed", "error", "skipped", "xfailed", "xpassed"]


def outcomes(records_path: str) -> dict[str, dict[str, Any]]:
    """nodeid -> {"outcome", "phases": {when: row}} with one outcome per test."""
    tests: dict[str, dict[str, Any]] = {}
    if not os.path.exists(records_path):
        return tests
    with open(records_path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            t = tests.setdefault(row["nodeid"], {"phases": {}})
            t["phases"][row["when"]] = row
    for t in tests.values():
        ph = t["phases"]
        call, setup, teardown, collect = (
            ph.get(k) for k in ("call", "setup", "teardown", "collect")
        )
        if collect is not None or (setup is not None and setup["outcome"] == "failed"):
            out = "error"
        elif setup is not None and setup["outcome"] == "skipped":
            out = "xfailed" if setup.get("xfail") else "skipped"
        elif call is not None and call["outcome"] == "failed":
            out = "failed"
        elif call is not None and call["outcome"] == "skipped":
            out = "xfailed" if call.get("xfail") else "skipped"
        elif call is not None and call.get("xfail"):
            out = "xpassed"
        elif teardown is not None and teardown["outcome"] == "failed":
            out = "error"  # passed, then failed at teardown (Lightning's zombie-thread check)
        else:
            out = "passed"
        t["outcome"] = out
    return tests


def _front_passed(test: dict[str, Any] | None) -> bool:
    """Whether a test's collect/setup/call phases all passed (teardown not considered)."""
    if test is None:
        return False
    ph = test["phases"]
    if "call" not in ph:
        return False
    return all(ph[w]["outcome"] != "failed" for w in ("collect", "setup", "call") if w in ph)


def _message_categories(test: dict[str, Any] | None, phases: tuple[str, ...]) -> list[str]:
    """Message categories of the failures of ``phases`` ([] if none failed; ["other"] if they
    match nothing)."""
    if test is None:
        return []
    failed = [
        r for w in phases
        if (r := test["phases"].get(w)) is not None and r["outcome"] == "failed"
    ]
    if not failed:
        return []
    whole = "\n".join((r.get("message") or "") + "\n" + (r.get("text") or "") for r in failed)
    e_lines = "\n".join(
        [r.get("message") or "" for r in failed]
        + [ln for r in failed for ln in (r.get("text") or "").splitlines() if ln.startswith("E ")]
    )
    found = [
        name for name, rx, where in CATEGORIES if rx.search(whole if where == "all" else e_lines)
    ]
    return found or ["other"]


def categorize(test: dict[str, Any], sync_test: dict[str, Any] | None = None,
               have_sync: bool = False) -> list[str]:
    """Categories of a failing test, the primary one first: ``async`` when the sync run passes
    its setup/call; else the categories of its setup/call failure, plus those the sync run's
    failure shows (a listing that is empty here because a save is pending may show a manifest
    there); then those only its teardown shows."""
    front = ("collect", "setup", "call")
    found: list[str] = []
    mine = _message_categories(test, front)
    if mine and have_sync:
        if _front_passed(sync_test):
            found.append("async")
        else:
            theirs = [c for c in _message_categories(sync_test, front) if c != "other"]
            if "other" in mine and theirs:
                mine = theirs + [c for c in mine if c != "other"]
            else:
                mine += [c for c in theirs if c not in mine]
    found += [c for c in mine if c not in found]
    found += [c for c in _message_categories(test, ("teardown",)) if c not in found]
    return found or ["other"]


def first_message(test: dict[str, Any]) -> str:
    for when in ("collect", "setup", "call", "teardown"):
        r = test["phases"].get(when)
        if r is not None and r["outcome"] == "failed":
            msg = " ".join((r.get("message") or "").split())
            return f"[{when}] {msg[:240]}"
    return ""


def summarize(run_dir: str, sync_dir: str | None = None) -> dict[str, Any]:
    with open(os.path.join(run_dir, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    tests = outcomes(os.path.join(run_dir, "records.jsonl"))
    sync = outcomes(os.path.join(sync_dir, "records.jsonl")) if sync_dir else {}
    counts = dict.fromkeys(COUNT_KEYS, 0)
    bad = {}
    teardown_failures = 0
    for nodeid, t in sorted(tests.items()):
        counts[t["outcome"]] += 1
        td = t["phases"].get("teardown")
        teardown_failures += td is not None and td["outcome"] == "failed"
        if t["outcome"] in ("failed", "error"):
            cats = categorize(t, sync.get(nodeid), have_sync=bool(sync_dir))
            bad[nodeid] = {"outcome": t["outcome"], "categories": cats, "message": first_message(t)}
    by_cat: dict[str, int] = defaultdict(int)
    for b in bad.values():
        by_cat[b["categories"][0]] += 1
    summary = {"meta": meta, "counts": counts, "ran": sum(counts.values()) - counts["skipped"],
               "teardown_failures": teardown_failures,
               "by_category": dict(by_cat), "not_passing": bad}
    with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
    return summary


def markdown(summaries: list[dict[str, Any]], reference: dict[str, Any] | None) -> str:
    lines = [
        ("| suite | mode | stagesave | passed | failed | errors | skipped | xfail/xpass | ran "
         "| teardown failures | wall | by category (primary) |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        m, c = s["meta"], s["counts"]
        by_count = sorted(s["by_category"].items(), key=lambda kv: -kv[1])
        cats = ", ".join(f"{k} {v}" for k, v in by_count)
        lines.append(
            f"| {m['suite']} | {m['mode']} | {m.get('stagesave', '-')} | {c['passed']} | "
            f"{c['failed']} | {c['error']} | {c['skipped']} | {c['xfailed']}/{c['xpassed']} | "
            f"{s['ran']} | "
            f"{s['teardown_failures']} | {m.get('wall_s', '?')} s | {cats or '-'} |"
        )
    for s in summaries:
        m = s["meta"]
        title = (f"### {m['suite']} / {m['mode']} / stagesave {m.get('stagesave', '-')}"
                 f" (pytest exit {m.get('exit_code', '?')})")
        source = f"Upstream: {m.get('upstream', '?')}. pytest: `{m.get('pytest_line', '?')}`"
        lines += ["", title, "", source, ""]
        if m.get("plugin_line"):
            lines += [f"Plugin: `{m['plugin_line']}`", ""]
        if not s["not_passing"]:
            lines.append("All selected tests passed or were skipped.")
            continue
        ref_bad = set()
        same_suite = reference is not None and reference["meta"]["suite"] == m["suite"]
        if reference is not None and same_suite and reference is not s:
            ref_bad = set(reference["not_passing"])
        grouped: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
        for nodeid, b in s["not_passing"].items():
            grouped[b["categories"][0]].append((nodeid, b))
        for cat in ORDER:
            if cat not in grouped:
                continue
            lines.append(f"**{cat}** ({len(grouped[cat])})")
            lines.append("")
            for nodeid, b in grouped[cat]:
                extra = [c for c in b["categories"][1:]]
                tag = " (also fails in the reference run)" if nodeid in ref_bad else ""
                more = f" [also: {', '.join(extra)}]" if extra else ""
                lines.append(f"- `{nodeid}` {b['outcome']}{more}{tag}: {b['message']}")
            lines.append("")
    return "\n".join(lines) + "\n"


def _mode(run_dir: str) -> str:
    with open(os.path.join(run_dir, "meta.json"), encoding="utf-8") as f:
        return str(json.load(f)["mode"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--reference", help="a plain run of the same suite, to mark failures it shares")
    ap.add_argument("--sync", help="a staged-sync run of the same suite and stagesave: staged "
                    "failures that pass there are categorized 'async'")
    ap.add_argument("--out", help="write the Markdown report here (default: stdout)")
    ns = ap.parse_args(argv)
    summaries = [
        summarize(r, ns.sync if ns.sync and _mode(r) == "staged" else None) for r in ns.runs
    ]
    reference = summarize(ns.reference) if ns.reference else None
    text = markdown(summaries, reference)
    if ns.out:
        with open(ns.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
