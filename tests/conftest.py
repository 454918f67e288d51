"""Shared fixtures of the engine tests: a tiny run, its dataset, one torch thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from diloco_peer.config import RunSpec
from diloco_peer.peer.data import TokenDataset, build_dataset

# Everything the engine tests train: the nano model on short sequences of a small corpus slice.
SMALL_RUN = RunSpec(
    model="nano",
    max_tokens=200_000,
    seq_len=32,
    batch_size=4,
    val_sequences=8,
    inner_steps=5,
    warmup_steps=5,
)


@pytest.fixture
def single_thread() -> Iterator[None]:
    """One intra-op thread: fast on a shared two-core box and bit-reproducible on CPU.

    The simulator calls torch.set_num_threads itself, so the previous count is restored after
    the test rather than leaking into the next one.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def small_run() -> RunSpec:
    return SMALL_RUN


@pytest.fixture(scope="session")
def small_dataset() -> TokenDataset:
    r = SMALL_RUN
    return build_dataset(r.data, r.tokenizer, r.seq_len, r.val_sequences, r.max_tokens, r.seed)
