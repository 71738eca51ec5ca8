"""Fixtures of the sampling tests."""

import pytest
import torch
from sampling_helpers import VOCAB


@pytest.fixture
def logits():
    """8 rows of logits over a 64-token vocabulary, wide enough that temperature matters."""
    return torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
