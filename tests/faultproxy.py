"""A small fault-injecting HTTP/1.1 proxy on loopback, between an S3 client and a real server.

It forwards requests unchanged (SigV4 signs the Host header the client sent, which the proxy
passes through), recognises the S3 operation of each request, and applies the first matching
:class:`Fault`: answer with an error status (``SlowDown``/503, ``InternalError``/500,
``AccessDenied``/403, ...), drop the connection in the middle of a request or response body,
delay the response, or flip one byte of a request or response body. ``down = True`` makes it
refuse every request, as an unreachable server would.

Used by the fault tests in ``tests/s3``; it holds whole bodies in memory, so keep objects small.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Fault", "FaultProxy", "classify"]

ACTIONS = ("status", "drop_request", "drop_response", "delay", "flip_request", "flip_response")


@dataclass
class Fault:
    """What to do to requests of operation ``op`` (``None``: any).

    ``skip`` matching requests pass untouched first, then the next ``times`` get the fault
    (``times=-1``: every one from then on).
    """

    op: str | None
    action: str
    times: int = 1
    skip: int = 0
    status: int = 503
    code: str = "SlowDown"
    delay_s: float = 0.0
    drop_after: int = 1024
    flip_offset: int = 0
    #: Only requests whose path (without the query) ends with this.
    path_suffix: str | None = None
    hits: int = 0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; one of {ACTIONS}")


def classify(method: str, target: str) -> str:
    """The S3 operation of a path-style request."""
    path, _, query = target.partition("?")
    q = parse_qs(query, keep_blank_values=True)
    parts = path.lstrip("/").split("/", 1)
    has_key = len(parts) == 2 and parts[1] != ""
    if method == "PUT":
        return "UploadPart" if "partNumber" in q else ("PutObject" if has_key else "CreateBucket")
    if method == "POST":
        if "uploads" in q:
            return "CreateMultipartUpload"
        return (
            "CompleteMultipartUpload"
            if "uploadId" in q
            else ("DeleteObjects" if "delete" in q else "Post")
        )
    if method == "DELETE":
        return (
            "AbortMultipartUpload"
            if "uploadId" in q
            else ("DeleteObject" if has_key else "DeleteBucket")
        )
    if method == "GET":
        if "uploadId" in q:
            return "ListParts"
        if "uploads" in q and not has_key:
            return "ListMultipartUploads"
        return "GetObject" if has_key else "ListObjectsV2"
    if method == "HEAD":
        return "HeadObject" if has_key else "HeadBucket"
    return method


class _Closed(Exception):
    pass


def _read_line(f) -> bytes:
    line = f.readline(65536)
    if not line:
        raise _Closed
    return line


def _read_head(f) -> tuple[bytes, list[tuple[str, str]]]:
    first = _read_line(f)
    headers = []
    while True:
        line = _read_line(f)
        if line in (b"\r\n", b"\n"):
            return first, headers
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))


def _get(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _read_body(
    f, headers: list[tuple[str, str]], no_body: bool = False, request: bool = False
) -> tuple[bytes, bool]:
    """The body (chunked bodies are returned with their framing) and whether it ran to EOF.

    A request without length or chunking has no body; a response without them runs to EOF.
    """
    if no_body:
        return b"", False
    length = _get(headers, "content-length")
    if length is not None:
        data = f.read(int(length))
        if len(data) < int(length):
            raise _Closed
        return data, False
    if (_get(headers, "transfer-encoding") or "").lower() == "chunked":
        out = bytearray()
        while True:
            line = _read_line(f)
            out += line
            size = int(line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:  # trailers
                    t = _read_line(f)
                    out += t
                    if t in (b"\r\n", b"\n"):
                        return bytes(out), False
            out += f.read(size + 2)
    if request:
        return b"", False
    return f.read(), True


def _head_bytes(first: bytes, headers: list[tuple[str, str]]) -> bytes:
    return first + b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers) + b"\r\n"


def _flip(body: bytes, offset: int) -> bytes:
    """Flip the lowest bit of byte ``offset`` (bodies shorter than that pass unchanged)."""
    if offset >= len(body):
        return body
    return body[:offset] + bytes([body[offset] ^ 0x01]) + body[offset + 1 :]


def _abort(sock: socket.socket) -> None:
    """Close with a TCP reset, as a crashed peer or a middlebox would."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


class _Link:
    """One client connection and its (lazily opened) upstream connection."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.client = conn.makefile("rb")
        self.upstream: socket.socket | None = None
        self._up_file = None

    def upstream_file(self, address: tuple[str, int]):
        if self.upstream is None:
            self.upstream = socket.create_connection(address)
            self._up_file = self.upstream.makefile("rb")
        return self._up_file

    def close(self) -> None:
        for s in (self.conn, self.upstream):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass


class FaultProxy:
    """Listens on 127.0.0.1 and forwards to ``upstream`` (``http://host:port``)."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.split("://", 1)[1].rstrip("/").partition(":")
        self.upstream = (host, int(port or 80))
        self.faults: list[Fault] = []
        self.requests: collections.Counter[str] = collections.Counter()
        self.injected: collections.Counter[str] = collections.Counter()
        #: Every request in arrival order: (operation, path and query).
        self.log: list[tuple[str, str]] = []
        #: Most requests of each operation in flight at once.
        self.max_in_flight: collections.Counter[str] = collections.Counter()
        self._in_flight: collections.Counter[str] = collections.Counter()
        self.down = False
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closing = False
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="faultproxy", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- control
    def add(self, *faults: Fault) -> None:
        with self._lock:
            self.faults.extend(faults)

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.requests.clear()
            self.injected.clear()
            self.log.clear()
            self.max_in_flight.clear()
        self.down = False

    def _take(self, op: str, target: str) -> Fault | None:
        path = target.partition("?")[0]
        with self._lock:
            for fault in self.faults:
                if fault.op not in (None, op):
                    continue
                if fault.path_suffix is not None and not path.endswith(fault.path_suffix):
                    continue
                if fault.skip > 0:
                    fault.skip -= 1
                    return None
                if fault.times == 0:
                    continue
                if fault.times > 0:
                    fault.times -= 1
                fault.hits += 1
                self.injected[op] += 1
                return fault
        return None

    def close(self) -> None:
        self._closing = True
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.close()
            except OSError:
                pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- serving
    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if self.down:
                _abort(conn)
                continue
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        link = _Link(conn)
        try:
            while True:
                first, headers = _read_head(link.client)
                method, target, _ = first.decode("latin-1").split(" ", 2)
                op = classify(method, target)
                with self._lock:
                    self.requests[op] += 1
                    self.log.append((op, target))
                    self._in_flight[op] += 1
                    self.max_in_flight[op] = max(self.max_in_flight[op], self._in_flight[op])
                try:
                    if not self._one(link, first, headers, method, target, op):
                        return
                finally:
                    with self._lock:
                        self._in_flight[op] -= 1
        except (_Closed, OSError, ValueError):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            link.close()

    def _one(
        self,
        link: _Link,
        first: bytes,
        headers: list[tuple[str, str]],
        method: str,
        target: str,
        op: str,
    ) -> bool:
        """Serve one request; False when the connection is finished."""
        conn = link.conn
        if self.down:
            _abort(conn)
            return False
        fault = self._take(op, target)
        action = fault.action if fault else None
        if (_get(headers, "expect") or "").lower() == "100-continue":
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")  # and do not forward the Expect
            headers = [(k, v) for k, v in headers if k.lower() != "expect"]
        if fault is not None and action == "drop_request":
            length = int(_get(headers, "content-length") or 0)
            link.client.read(min(fault.drop_after, length))
            _abort(conn)
            return False
        body, _ = _read_body(link.client, headers, request=True)
        if fault is not None and action == "status":
            self._reply_error(conn, fault, target, method == "HEAD")
            return True
        if fault is not None and action == "delay":
            time.sleep(fault.delay_s)
        if fault is not None and action == "flip_request":
            body = _flip(body, fault.flip_offset)
        up = link.upstream_file(self.upstream)
        assert link.upstream is not None
        link.upstream.sendall(_head_bytes(first, headers) + body)
        while True:
            rfirst, rheaders = _read_head(up)
            if not rfirst.split(b" ", 2)[1].startswith(b"1"):
                break
        status = int(rfirst.split(b" ", 2)[1])
        rbody, to_eof = _read_body(up, rheaders, no_body=method == "HEAD" or status in (204, 304))
        if fault is not None and action == "flip_response" and status < 300:
            rbody = _flip(rbody, fault.flip_offset)
        if fault is not None and action == "drop_response":
            conn.sendall(
                _head_bytes(rfirst, rheaders) + rbody[: min(fault.drop_after, len(rbody) // 2)]
            )
            _abort(conn)
            return False
        conn.sendall(_head_bytes(rfirst, rheaders) + rbody)
        return not to_eof and (_get(rheaders, "connection") or "").lower() != "close"

    @staticmethod
    def _reply_error(conn: socket.socket, fault: Fault, target: str, head_only: bool) -> None:
        reason = {
            403: "Forbidden",
            404: "Not Found",
            500: "Internal Server Error",
            503: "Service Unavailable",
        }
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{fault.code}</Code><Message>injected by faultproxy</Message>"
            f"<Resource>{target.partition('?')[0]}</Resource><RequestId>faultproxy</RequestId></Error>"
        ).encode()
        head = (
            f"HTTP/1.1 {fault.status} {reason.get(fault.status, 'Error')}\r\n"
            "Content-Type: application/xml\r\n"
            f"Content-Length: {len(xml)}\r\n\r\n"
        ).encode()
        conn.sendall(head if head_only else head + xml)
