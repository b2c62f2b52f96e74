"""Checkpoints served by a plain HTTP server (no ranges, no sizes in its listing) load and
verify."""

from __future__ import annotations

import functools
import http.server
import threading

import pytest
import torch

import stagesave


@pytest.fixture
def served(tmp_path):
    """``tmp_path`` served read-only by Python's http.server (it ignores Range headers)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_checkpoint_over_plain_http_verifies_loads_and_is_latest(served):
    root, url = served
    state = {"w": torch.randn(5000), "step": 7}
    with stagesave.Checkpointer(root) as ck:
        ck.save({"w": torch.zeros(3), "step": 6}, "a.ckpt").result()
        ck.save(state, "b.ckpt").result()
    info = stagesave.verify(f"{url}/b.ckpt")
    assert info.status == "verified" and info.path == f"{url}/b.ckpt"
    loaded = stagesave.load(f"{url}/b.ckpt")
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 7
    best = stagesave.latest(url)
    assert best is not None and best.name == "b.ckpt"
