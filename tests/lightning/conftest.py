"""Fixtures of the Lightning tests (the helpers live in ``lightning_helpers``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lightning_helpers import WriterGate


@pytest.fixture
def gate() -> Iterator[WriterGate]:
    """A closed :class:`WriterGate`, opened again at the end of the test."""
    g = WriterGate()
    g.close()
    yield g
    g.open()
