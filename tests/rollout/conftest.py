"""Fixtures shared by the rollout tests."""

from __future__ import annotations

import pytest

from .fake_vllm import FakeVLLM


@pytest.fixture
def fakes():
    """Two scripted vLLM stand-ins (`fake_vllm`), closed after the test."""
    servers = [FakeVLLM(), FakeVLLM()]
    yield servers
    for s in servers:
        s.close()
