"""Argument parsing, dispatch, and the one-line error policy."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .. import __version__
from ..errors import CheckpointError
from ._common import CliError, Env, parse_storage_options, shown

__all__ = ["build_parser", "main"]

#: Exit status when a command found problems or failed.
EXIT_FAILURE = 1
#: Exit status for unusable arguments (argparse uses it too).
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    from . import (
        _adopt,
        _bench,
        _clean,
        _export,
        _inspect,
        _ls,
        _migrate,
        _plan,
        _report,
        _verify,
    )

    parser = argparse.ArgumentParser(
        prog="stagesave",
        description="Plan, inspect, verify, convert, migrate and clean up stagesave (and plain "
                    "torch) checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"stagesave {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show tracebacks instead of one-line errors"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// paths (e.g. http://127.0.0.1:8333)")
    parser.add_argument(
        "-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
        help="fsspec storage option for URLs (repeatable; VALUE may be JSON), e.g. -o anon=true",
    )
    parser.add_argument(
        "--retries", type=int, metavar="N",
        help="attempts per S3 request before giving up (default: the store's, 8); 1 fails fast",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    commands = (_plan, _ls, _inspect, _verify, _export, _adopt, _migrate, _clean, _bench, _report)
    for module in commands:
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``stagesave`` command; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    env: Env | None = None
    try:
        env = Env(
            storage_options=parse_storage_options(args.storage_option, args.endpoint_url),
            debug=args.debug,
            quiet=args.quiet,
            retries=args.retries,
        )
        if args.retries is not None and args.retries < 1:
            raise CliError("--retries must be at least 1", EXIT_USAGE)
        status: int = args.func(env, args)
        return status
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("stagesave: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"stagesave: error: {shown(_one_line(exc))}", file=sys.stderr)
        return exc.code if isinstance(exc, CliError) else EXIT_FAILURE
    finally:
        if env is not None:
            env.close()


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, (CliError, CheckpointError)):
        text = str(exc)
    elif isinstance(exc, OSError) and exc.strerror and exc.filename:
        text = f"{exc.filename}: {exc.strerror}"
    else:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return " ".join(text.split())
