"""Tokenizers, packed token datasets, shards and resumable shard streams (the documents come
from sources.py).

Documents are tokenized, joined by a separator and packed into non-overlapping windows of
`seq_len + 1` tokens (each window holds its own next-token targets); a seeded subset is held out.
Shards are index tensors into the training windows, i.i.d. or k-means on model features (DiLoCo
§3). `ShardStream`'s position is two integers, so a peer resumes it exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from diloco_peer.errors import DataError
from diloco_peer.peer.sources import iter_source_texts, short_error

logger = logging.getLogger(__name__)

_DOC_SEPARATOR = "\n\n"
_BPE_TRAIN_CHARS = 2_000_000  # enough text for a small BPE vocabulary, trained in about a second


# --------------------------------------------------------------------------- tokenizers


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no files, nothing to train."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        # A window boundary can cut a multi-byte character; replace rather than fail.
        return bytes(ids).decode("utf-8", errors="replace")


class _HFTokenizer:
    """A `tokenizers.Tokenizer` as a `Tokenizer`; no BOS/EOS: the dataset's separator splits docs."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._backend.decode(list(ids)))


def load_tokenizer(spec: str, texts: Iterable[str] | None = None) -> Tokenizer:
    """A tokenizer from its spec: "bytes", "bpe:N" (trained on `texts`) or a tokenizer JSON file."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        return _train_bpe(spec, texts)
    path = Path(spec).expanduser()
    if path.is_file():
        from tokenizers import Tokenizer as HFTokenizer

        try:
            return _HFTokenizer(HFTokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises plain Exception for unreadable files
            raise DataError(f"cannot read tokenizer file {path}: {short_error(exc)}") from None
    if path.suffix == ".json":
        raise DataError(f"tokenizer file not found: {spec}")
    raise DataError(
        f"unknown tokenizer {spec!r}; use 'bytes', 'bpe:N' (byte-level BPE with N > 256 tokens "
        "trained on the data) or the path of a Hugging Face tokenizers JSON file"
    )


def _train_bpe(spec: str, texts: Iterable[str] | None) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    size_text = spec.removeprefix("bpe:")
    if not size_text.isdigit() or int(size_text) <= 256:
        raise DataError(f"bad tokenizer {spec!r}: expected 'bpe:N' with an integer N > 256")
    if texts is None:
        raise DataError(f"tokenizer {spec!r} is trained on the data, but no texts were given")
    sample: list[str] = []
    chars = 0
    for text in texts:
        sample.append(text[: _BPE_TRAIN_CHARS - chars])
        chars += len(sample[-1])
        if chars >= _BPE_TRAIN_CHARS:
            break
    if chars == 0:
        raise DataError(f"tokenizer {spec!r}: no text to train on")
    # Byte-level BPE (GPT-2 style): every string is encodable, and decode(encode(s)) == s.
    # Training is deterministic for the same texts (checked across processes with tokenizers 0.23).
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=int(size_text), initial_alphabet=alphabet, show_progress=False
    )
    backend.train_from_iterator(sample, trainer=trainer)
    tokenizer = _HFTokenizer(backend)
    # A small corpus can run out of merges before N; the vocabulary is then smaller.
    logger.info("trained %s on %d characters: vocabulary %d", spec, chars, tokenizer.vocab_size)
    return tokenizer


# --------------------------------------------------------------------------- datasets


@dataclass(frozen=True)
class TokenDataset:
    train: torch.Tensor
    """int64 [n_train, seq_len + 1] packed windows, in source order."""
    val: torch.Tensor
    """int64 [n_val, seq_len + 1] held-out windows, in source order, never in `train`."""
    vocab_size: int
    tokenizer: Tokenizer


def build_dataset(
    source: str,
    tokenizer: str,
    seq_len: int,
    val_sequences: int,
    max_tokens: int = 0,
    seed: int = 0,
) -> TokenDataset:
    """Tokenize `source`, pack it into windows of `seq_len + 1` tokens and hold some out.

    Reads at most `max_tokens` tokens (0: all). The same arguments give identical tensors.
    """
    if seq_len < 1 or val_sequences < 0 or max_tokens < 0:
        raise DataError(
            f"need seq_len >= 1, val_sequences >= 0, max_tokens >= 0 (0: no cap); got "
            f"{seq_len}, {val_sequences}, {max_tokens}"
        )
    training_texts = iter_source_texts(source) if tokenizer.startswith("bpe:") else None
    tok = load_tokenizer(tokenizer, training_texts)
    stream = _pack(iter_source_texts(source), _encoder(tok), max_tokens)

    width = seq_len + 1
    n = len(stream) // width  # the tail shorter than a window is dropped
    if n < val_sequences + 1:
        capped = f" (capped by max_tokens={max_tokens})" if max_tokens else ""
        raise DataError(
            f"data source {source!r} gave {len(stream)} tokens{capped}, {n} windows of {width}; "
            f"{val_sequences} validation windows plus one training window need "
            f"{(val_sequences + 1) * width} tokens"
        )
    windows = torch.from_numpy(stream[: n * width].astype(np.int64)).view(n, width)
    generator = torch.Generator().manual_seed(seed)
    val_index = torch.randperm(n, generator=generator)[:val_sequences].sort().values
    is_val = torch.zeros(n, dtype=torch.bool)
    is_val[val_index] = True
    train, val = windows[~is_val].contiguous(), windows[val_index].contiguous()
    logger.info(
        "dataset %s: %d tokens, %d train + %d val windows of %d, vocabulary %d",
        *(source, len(stream), len(train), len(val), width, tok.vocab_size),
    )
    return TokenDataset(train=train, val=val, vocab_size=tok.vocab_size, tokenizer=tok)


def _encoder(tok: Tokenizer) -> Callable[[str], np.ndarray]:
    if isinstance(tok, ByteTokenizer):  # fast path: one buffer per document, no Python list
        return lambda text: np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return lambda text: np.asarray(tok.encode(text), dtype=np.int64)


def _pack(texts: Iterator[str], encode: Callable[[str], np.ndarray], max_tokens: int) -> np.ndarray:
    """Documents encoded and joined by the separator, cut at `max_tokens` (0: no cap)."""
    separator = encode(_DOC_SEPARATOR)
    parts: list[np.ndarray] = []
    count = -len(separator)
    for text in texts:
        parts += [separator, encode(text)]
        count += len(separator) + len(parts[-1])
        if max_tokens and count >= max_tokens:
            break  # stop reading: the builtin corpus is 12 MB, a hub one may be endless
    return np.concatenate(parts[1:])[: max_tokens or None]


# --------------------------------------------------------------------------- shards


def iid_shards(n: int, num_shards: int, seed: int) -> list[torch.Tensor]:
    """A seeded permutation of range(n) cut into `num_shards` non-empty, nearly equal parts.

    Each part is a sorted int64 index tensor; part sizes differ by at most one.
    """
    if num_shards < 1 or n < num_shards:
        raise DataError(f"cannot split {n} sequences into {num_shards} non-empty shards")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return [part.sort().values for part in torch.tensor_split(perm, num_shards)]


@torch.no_grad()
def sequence_features(
    model: torch.nn.Module, sequences: torch.Tensor, batch_size: int = 64
) -> torch.Tensor:
    """Float32 [n, C]: each sequence's last-layer hidden states averaged over positions.

    These are the features the DiLoCo paper (§3, non-i.i.d. data) clusters into shards.
    The model runs in eval mode and gets its previous mode back afterwards.
    """
    if sequences.dim() != 2 or sequences.shape[0] == 0 or sequences.shape[1] < 2 or batch_size < 1:
        raise DataError(
            f"need sequences [n >= 1, T + 1 >= 2] and batch_size >= 1, got "
            f"{list(sequences.shape)} and {batch_size}"
        )
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        features = [
            model.hidden_states(chunk[:, :-1].to(device)).float().mean(dim=1).cpu()  # [b, C]
            for chunk in sequences.split(batch_size)
        ]
    finally:
        model.train(was_training)
    return torch.cat(features)


def kmeans_shards(
    features: torch.Tensor, num_shards: int, seed: int, iters: int = 25
) -> list[torch.Tensor]:
    """Cluster rows of `features` [n, C] into `num_shards` non-empty shards (sorted index tensors).

    Euclidean k-means on standardized features (each dimension to zero mean and unit variance,
    so that no few large hidden dimensions dominate the distance), k-means++ initialisation from
    a generator seeded with `seed`, then at most `iters` Lloyd iterations. Computed in float64
    on CPU to keep the result stable. A cluster that empties is re-seeded with the point farthest
    from its own centre, so every shard is non-empty; shard sizes may differ.
    """
    x = features.detach().to("cpu", torch.float64)
    if x.dim() != 2 or not 1 <= num_shards <= len(x) or iters < 1 or not x.isfinite().all():
        raise DataError(
            f"cannot cluster features of shape {list(x.shape)} into {num_shards} non-empty "
            f"shards with {iters} iterations (features must be [n, C], finite)"
        )
    std = x.std(dim=0, unbiased=False)  # constant dimensions are left at zero
    x = (x - x.mean(dim=0)) / torch.where(std > 1e-12, std, torch.ones_like(std))

    generator = torch.Generator().manual_seed(seed)
    centers = _kmeans_plus_plus(x, num_shards, generator)
    previous: torch.Tensor | None = None
    for _ in range(iters):
        assign = _fill_empty_clusters(*_nearest(x, centers), num_shards)
        if previous is not None and torch.equal(assign, previous):
            break
        previous = assign
        counts = torch.bincount(assign, minlength=num_shards).to(x.dtype)
        centers = torch.zeros_like(centers).index_add_(0, assign, x) / counts[:, None]
    return [torch.nonzero(assign == k).flatten() for k in range(num_shards)]


def _nearest(x: torch.Tensor, centers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of each point's nearest centre (ties to the lower index) and the squared distance."""
    d2 = (x * x).sum(1, keepdim=True) - 2 * x @ centers.T + (centers * centers).sum(1)
    d2 = d2.clamp_min(0.0)  # [n, k]; rounding can push an exact match slightly below zero
    best, assign = d2.min(dim=1)
    return assign, best


def _kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding (Arthur & Vassilvitskii, 2007): each next centre drawn with prob ∝ D²."""
    n = x.shape[0]
    chosen = [int(torch.randint(n, (1,), generator=generator))]
    d2 = ((x - x[chosen[0]]) ** 2).sum(1)
    for _ in range(1, k):
        if d2.sum() > 0:
            nxt = int(torch.multinomial(d2, 1, generator=generator))
        else:  # fewer distinct points than clusters: any unchosen point will do
            rest = torch.ones(n, dtype=torch.bool)
            rest[chosen] = False
            nxt = int(torch.nonzero(rest)[0])
        chosen.append(nxt)
        d2 = torch.minimum(d2, ((x - x[nxt]) ** 2).sum(1))
    return x[chosen].clone()


def _fill_empty_clusters(assign: torch.Tensor, dist: torch.Tensor, k: int) -> torch.Tensor:
    assign, dist = assign.clone(), dist.clone()
    for cluster in range(k):
        counts = torch.bincount(assign, minlength=k)
        if counts[cluster] > 0:
            continue
        # Farthest point from its own centre, among clusters that can spare one.
        movable = counts[assign] > 1
        point = int(torch.where(movable, dist, torch.full_like(dist, -1.0)).argmax())
        assign[point] = cluster
        dist[point] = -1.0  # not moved again in this pass
    return assign


# --------------------------------------------------------------------------- streams


class ShardStream:
    """Endless batches from one shard, reshuffled each epoch with a seed; resumable.

    Epoch e visits the shard in the order torch.randperm(len(indices)) drawn from a generator
    seeded with `seed * 1_000_003 + e`, so (epoch, position) fully determines what comes next.
    """

    def __init__(
        self, data: torch.Tensor, indices: torch.Tensor, batch_size: int, seed: int
    ) -> None:
        if indices.dim() != 1 or indices.numel() == 0 or indices.is_floating_point():
            raise DataError("shard indices must be a non-empty 1-D integer tensor")
        if data.dim() != 2 or int(indices.min()) < 0 or int(indices.max()) >= len(data):
            raise DataError(f"shard indices out of range for data of shape {list(data.shape)}")
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        self._data = data
        self._indices = indices.to(torch.int64)
        self._batch_size = batch_size
        self._seed = seed
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self._seed * 1_000_003 + epoch)
        return self._indices[torch.randperm(len(self._indices), generator=generator)]

    def next_batch(self) -> torch.Tensor:
        """int64 [batch_size, seq_len + 1]; a batch may take its tail from the next epoch."""
        picks: list[torch.Tensor] = []
        needed = self._batch_size
        while needed > 0:
            take = self._order[self._position : self._position + needed]
            picks.append(take)
            needed -= len(take)
            self._position += len(take)
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
        return self._data[torch.cat(picks)]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not isinstance(state, Mapping) or set(state) != {"epoch", "position"}:
            raise DataError(f"bad stream state {state!r}: expected keys 'epoch' and 'position'")
        epoch, position = state["epoch"], state["position"]
        for name, value in (("epoch", epoch), ("position", position)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DataError(f"bad stream state: {name} must be an integer >= 0, got {value!r}")
        if position >= len(self._indices):
            raise DataError(
                f"bad stream state: position {position} outside a shard of {len(self._indices)}"
            )
        self._epoch, self._position = epoch, position
        self._order = self._epoch_order(epoch)

    @property
    def samples_seen(self) -> int:
        return self._epoch * len(self._indices) + self._position
