"""What every command shares: where output goes, progress bars, storage options, targets."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.text import Text

from ..errors import CheckpointNotFoundError
from ..stores.base import Store
from ..stores.targets import StoreResolver, is_url

__all__ = ["CliError", "Env", "Target", "jsonable", "literal", "parse_storage_options", "shown"]


class CliError(Exception):
    """A failure to report as one line (``stagesave: error: ...``) with exit status ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


#: Options that are always strings, even when they look like numbers (credentials above all).
_STRING_OPTIONS = frozenset(
    {"key", "secret", "token", "username", "password", "profile", "endpoint_url", "region_name"}
)


def _option_value(key: str, value: str) -> Any:
    if key in _STRING_OPTIONS:
        return value
    if (
        value in ("true", "false", "null")
        or value.startswith(("{", "["))
        or re.fullmatch(r"-?\d+(\.\d+)?", value)
    ):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def parse_storage_options(pairs: list[str], endpoint_url: str | None) -> dict[str, Any]:
    """``KEY=VALUE`` pairs plus ``--endpoint-url``. VALUE is read as JSON when it is a boolean,
    null, number, object or array, except for credentials and names, which stay strings.

    Raises:
        CliError: a pair has no ``=``.
    """
    opts: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise CliError(f"--storage-option {pair!r}: expected KEY=VALUE, e.g. anon=true", 2)
        opts[key] = _option_value(key, value)
    if endpoint_url:
        opts["endpoint_url"] = endpoint_url
    return opts


class _Resolver(StoreResolver):
    """The core's resolver, with the CLI's retry budget for ``s3://`` roots."""

    def __init__(self, storage_options: dict[str, Any], retries: int | None) -> None:
        super().__init__(None, storage_options=storage_options)
        self.retries = retries
        self._s3: dict[str, Store] = {}

    def store_for(self, url: str) -> Store:
        if self.retries is None or not url.startswith(("s3://", "s3a://")):
            return super().store_for(url)
        key = url.rstrip("/")
        if key not in self._s3:
            from ..stores.s3 import RetryPolicy, S3Store

            self._s3[key] = S3Store(
                key, self.storage_options, retry=RetryPolicy(max_attempts=self.retries)
            )
        return self._s3[key]

    def close(self) -> None:
        for store in self._s3.values():
            store.close()
        self._s3.clear()
        super().close()


@dataclass
class Target:
    """A path the user named: a file or a folder, in a store."""

    store: Store
    name: str
    is_dir: bool

    @property
    def where(self) -> str:
        return self.store.describe(self.name) if self.name else self.store.url


@dataclass
class Env:
    """Consoles, interactivity and storage options for one invocation."""

    storage_options: dict[str, Any] = field(default_factory=dict)
    debug: bool = False
    quiet: bool = False
    retries: int | None = None
    out: Console = field(default_factory=lambda: _console(sys.stdout))
    err: Console = field(default_factory=lambda: _console(sys.stderr))

    def __post_init__(self) -> None:
        self._resolver: _Resolver | None = None

    @property
    def interactive(self) -> bool:
        """Progress bars only on a terminal, and never with ``--quiet``."""
        return not self.quiet and self.err.is_terminal

    @property
    def resolver(self) -> _Resolver:
        """One resolver (and its cached connections) for the whole invocation."""
        if self._resolver is None:
            self._resolver = _Resolver(self.storage_options, self.retries)
        return self._resolver

    def close(self) -> None:
        if self._resolver is not None:
            self._resolver.close()

    def root(self, path: str) -> Store:
        """The store whose root is folder ``path``.

        Raises:
            CliError: a local path that does not exist or is not a folder.
        """
        if not is_url(path):
            local = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
            if not os.path.exists(local):
                raise CliError(f"{local} does not exist")
            if not os.path.isdir(local):
                raise CliError(
                    f"{local} is a file, not a checkpoint folder (use inspect/verify on files)"
                )
        return self.resolver.dir_store(path)

    def target(self, path: str) -> Target:
        """A file or folder the user named.

        Raises:
            CheckpointNotFoundError: nothing exists at ``path``.
        """
        if not is_url(path):
            local = os.path.abspath(os.path.expanduser(path.removeprefix("file://")))
            if os.path.isdir(local):
                parent, leaf = os.path.split(local.rstrip("/"))
                if not leaf:  # "/" itself
                    return Target(self.resolver.store_for(local), "", True)
                return Target(self.resolver.store_for(parent), leaf, True)
            if not os.path.exists(local):
                raise CheckpointNotFoundError(f"no such file or folder: {local}")
        store, name = self.resolver.split(path)
        try:
            store.info(name)
            return Target(store, name, False)
        except IsADirectoryError:
            return Target(store, name, True)
        except FileNotFoundError:
            if name in store.list_dirs(""):
                return Target(store, name, True)
            raise CheckpointNotFoundError(
                f"no such file or folder: {store.describe(name)}"
            ) from None

    @contextlib.contextmanager
    def progress(self, description: str, total: float | None) -> Iterator[Callable[[float], None]]:
        """A progress bar (bytes) on a terminal; a no-op elsewhere. Yields ``advance(n)``."""
        if not self.interactive:
            yield lambda n: None
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        lock = threading.Lock()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.err,
            transient=True,
        ) as bar:
            task = bar.add_task(description, total=total)

            def advance(n: float) -> None:
                with lock:
                    bar.advance(task, n)

            yield advance

    def print_json(self, doc: Any) -> None:
        """Machine-readable output: plain JSON on stdout, no styling (always valid JSON: a
        non-finite number read from a proof is written as ``null``)."""
        sys.stdout.write(json.dumps(jsonable(doc), indent=2, default=str, allow_nan=False) + "\n")
        sys.stdout.flush()

    def say(self, message: str, *, err: bool = False) -> None:
        """Print one line of plain text (names in it are shown literally, never as markup)."""
        (self.err if err else self.out).print(literal(message))


def _console(stream: Any) -> Console:
    # Off a terminal rich would wrap (and cut) at 80 columns: tables take the width of their
    # content instead, so pipes and logs get whole names, ids and messages.
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 1000
    return Console(file=stream, width=width, soft_wrap=True, highlight=False, emoji=False)


def shown(text: str) -> str:
    """``text`` with control and format characters escaped (``\\x1b``, ``\\n``, ``\\u202e``): a
    file name or a string from a checkpoint can neither forge lines nor drive the terminal."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable():
            out.append(ch)
        else:
            code = ord(ch)
            out.append(
                f"\\x{code:02x}"
                if code < 0x100
                else f"\\u{code:04x}"
                if code < 0x10000
                else f"\\U{code:08x}"
            )
    return "".join(out)


def literal(text: str, style: str = "") -> Text:
    """A rich ``Text`` that prints ``text`` exactly (no markup, controls escaped)."""
    return Text(shown(text), style=style)


def jsonable(doc: Any, depth: int = 0) -> Any:
    """``doc`` with every non-finite float replaced by ``None`` (JSON has no NaN or infinity;
    Python's parser reads ``1e999`` as infinity, so a proof may hold one)."""
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if depth > 200:
        return str(doc)
    if isinstance(doc, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [jsonable(v, depth + 1) for v in doc]
    return doc
