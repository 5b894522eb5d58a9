"""Fixtures the tests of ``fp8_plugin/modules/`` share."""

import pytest
import torch


@pytest.fixture
def fresh_dynamo():
    """dynamo's caches cleared before and after the test: its compiled graphs, guards and
    recompile counts are the test's own."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
