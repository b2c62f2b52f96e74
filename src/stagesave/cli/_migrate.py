"""``stagesave migrate ROOT``: format-1 checkpoints rewritten in place as format-2 checkpoints.

A format-1 checkpoint is a file plus a sidecar manifest ``<name>.<id>.stagesave.json`` (or a
folder plus its ``checkpoint.stagesave.json``). Migrating one:

1. reads every byte into page-aligned memory once and **verifies** it against the sidecar
   (size, serialization id, every chunk) through those very bytes: a checkpoint that does not
   verify is reported and left alone;
2. re-plans it without unpickling anything: a torch file's own zip is parsed
   (``ondisk/torchzip.py``) and its bytes become the file image as they are (storages at
   their record offsets, every record given its real CRC-32); in a folder, safetensors files
   are laid out again with room for their proof (same tensors, same metadata) and any other
   file is kept byte for byte as a raw file the folder's proof lists;
3. commits it with the core's commit (``saving/commit.py``): written
   under a temporary name, made durable, sealed with its proof, then renamed over the old one
   (a folder: swapped with it) in one atomic step. The sidecars go afterwards. A crash leaves
   the old checkpoint or the new one, never neither.

The metadata, the tensor index and the telemetry of the original save are carried over (the
telemetry gains ``migrated``: the original creation time and sidecar). Order: a migrated
checkpoint keeps its original creation time and takes sequence number 0, below every checkpoint
format 2 ever saved (those start at 1), so format-1 checkpoints, which predate them, stay older
than any of them, in their original order among themselves, and migrating in any order or
with format-2 checkpoints already there never makes ``latest()`` return an older one. Sharded
(DCP) folders are reported ("re-save to migrate") and left alone; so are files
``stagesave adopt`` certified (stagesave must not modify them) unless ``--include-adopted``.
"""
from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from ..restore.discovery import CheckpointInfo, resolve, resolve_dir, scan
from ..stores.base import Store
from ._common import CliError, Env, literal
from ._migrate_one import Result, migrate_file, migrate_folder
from ._replan import NotMigratable, torch_image

__all__ = ["Result", "add_parser", "migrate", "run", "torch_image"]


# ---------------------------------------------------------------------------- a root
def _format1(store: Store, name: str, is_dir: bool) -> list[CheckpointInfo]:
    """The format-1 checkpoints a path names: the checkpoint itself, or those directly in a root."""
    if name:
        ci = resolve_dir(store, name) if is_dir else resolve(store, name)
        return [ci] if ci.format == 1 else []
    return [c for c in scan(store, "", full=True) if c.format == 1]


def migrate(
    env: Env,
    store: Store,
    name: str,
    is_dir: bool,
    *,
    dry_run: bool = False,
    adopted_too: bool = False,
) -> list[Result]:
    """Migrate the format-1 checkpoints ``name`` names in ``store`` (``""``: every one directly
    in the root), oldest first. One that cannot be migrated is reported and left as it is."""
    todo = sorted(_format1(store, name, is_dir), key=lambda c: c.created)
    if not todo:
        return []
    results: list[Result] = []
    for ci in todo:
        if ci.status != "committed":
            results.append(
                Result(ci.path, ci.is_dir, "failed", "does not verify", problems=list(ci.problems))
            )
            continue
        try:
            if ci.is_dir:
                results.append(migrate_folder(env, store, ci, dry_run=dry_run))
            else:
                results.append(
                    migrate_file(env, store, ci, dry_run=dry_run, adopted_too=adopted_too)
                )
        except NotMigratable as exc:
            results.append(Result(ci.path, ci.is_dir, exc.action, str(exc)))
    return results


# ---------------------------------------------------------------------------- command
def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "migrate",
        help="rewrite format-1 checkpoints (sidecar manifests) in place as checkpoints that carry "
             "their own proof",
        description="Turn the format-1 checkpoints directly under ROOT (a file and its sidecar "
        "<name>.<id>.stagesave.json, or a folder with checkpoint.stagesave.json), or the one PATH "
        "names, into format-2 checkpoints that carry their own proof: each is verified first, "
        "re-planned without unpickling, committed over the old one atomically, then its sidecars "
        "are removed. Metadata, tensor index and telemetry are kept. Sharded (DCP) folders are "
        "left (re-save to migrate); so are files `stagesave adopt` certified, unless "
        "--include-adopted. --dry-run only verifies and lists.",
    )
    p.add_argument("root", metavar="ROOT|PATH")
    p.add_argument(
        "--dry-run",
        "-n",
        action="store_true",
        help="verify and list what would be migrated, change nothing",
    )
    p.add_argument(
        "--include-adopted",
        action="store_true",
        help="also rewrite files `stagesave adopt` certified (stagesave did not write them)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


_STYLE = {
    "migrated": "green",
    "would migrate": "green",
    "skipped": "yellow",
    "refused": "red",
    "failed": "bold red",
}


def run(env: Env, args: argparse.Namespace) -> int:
    target = env.target(args.root)
    if target.is_dir and (not target.name or resolve_dir(target.store, target.name).format == 0):
        store, name, is_dir = env.root(args.root), "", True  # a root holding checkpoints
    else:
        store, name, is_dir = target.store, target.name, target.is_dir
    results = migrate(
        env, store, name, is_dir, dry_run=args.dry_run, adopted_too=args.include_adopted
    )
    bad = [r for r in results if r.action in ("failed", "refused")]
    if args.json:
        env.print_json(
            {
                "root": store.describe(name) if name else store.url,
                "dry_run": args.dry_run,
                "checkpoints": [r.to_dict() for r in results],
            }
        )
    elif not results:
        env.say(
            f"no format-1 checkpoints at {store.describe(name) if name else store.url}; nothing to "
            "migrate"
        )
    else:
        t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        for col in ("checkpoint", "result", "detail"):
            t.add_column(col, overflow="fold")
        for r in results:
            t.add_row(
                literal(r.path + ("/" if r.folder else "")),
                literal(r.action, _STYLE.get(r.action, "")),
                literal(r.detail),
            )
        env.out.print(t)
        for r in results:
            for p in r.problems:
                env.say(f"  {r.path}: {p}")
        n = sum(1 for r in results if r.action in ("migrated", "would migrate"))
        env.say(
            f"{n} of {len(results)} format-1 checkpoints "
            f"{'would be ' if args.dry_run else ''}migrated"
        )
    if bad:
        first = bad[0]
        reason = first.problems[0] if first.problems else first.detail
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CliError(f"{first.path} was not migrated: {reason}{more}")
    return 0
