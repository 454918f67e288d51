"""Tests of diloco_peer.peer.data: sources, tokenizers, packing, shards and resumable streams."""

from __future__ import annotations

import json
import sysconfig
import time
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from diloco_peer.errors import DataError
from diloco_peer.peer.data import (
    ByteTokenizer,
    ShardStream,
    TokenDataset,
    build_dataset,
    iid_shards,
    kmeans_shards,
    load_tokenizer,
    sequence_features,
)
from diloco_peer.peer.model import build_model
from diloco_peer.peer.sources import iter_source_texts

ASCII_SAMPLE = "def mean(xs):\n    return sum(xs) / len(xs)  # the average, 42!\n"


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    """A small corpus: plain files in nested directories plus files that must be ignored."""
    root = tmp_path / "corpus"
    (root / "b_sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    words = ["alpha", "beta", "gamma", "delta", "return", "value", "index", "tensor"]
    for i in range(12):
        body = " ".join(words[(i + j) % len(words)] for j in range(400))
        (root / f"doc{i:02d}.txt").write_text(f"# doc {i}\n{body}\n", encoding="utf-8")
    (root / "b_sub" / "notes.md").write_text("markdown notes, nested\n", encoding="utf-8")
    (root / "b_sub" / "code.py").write_text(ASCII_SAMPLE, encoding="utf-8")
    (root / ".hidden" / "secret.txt").write_text("never read\n", encoding="utf-8")
    (root / "image.png").write_bytes(b"\x89PNG not text")
    return root


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld ✓\n\ttabs 🚀"
    ids = tok.encode(text)
    assert tok.vocab_size == 256
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # a cut character is replaced, not an error
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)


def test_bpe_trains_deterministically_and_round_trips(text_dir: Path) -> None:
    first = load_tokenizer("bpe:300", iter_source_texts(str(text_dir)))
    second = load_tokenizer("bpe:300", iter_source_texts(str(text_dir)))
    assert 256 < first.vocab_size <= 300
    ids = first.encode(ASCII_SAMPLE)
    assert len(ids) < len(ASCII_SAMPLE)  # merges were learned
    assert first.decode(ids) == ASCII_SAMPLE
    assert second.encode(ASCII_SAMPLE) == ids


def test_tokenizer_json_file(tmp_path: Path) -> None:
    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator([ASCII_SAMPLE * 20], trainer=trainer)
    path = tmp_path / "tok.json"
    backend.save(str(path))

    tok = load_tokenizer(str(path))
    assert tok.vocab_size == backend.get_vocab_size()
    assert tok.encode(ASCII_SAMPLE) == backend.encode(ASCII_SAMPLE).ids


@pytest.mark.parametrize("spec", ["byte", "bpe:abc", "bpe:100", "wordpiece:3000", "missing.json"])
def test_bad_tokenizer_spec(spec: str) -> None:
    with pytest.raises(DataError):
        load_tokenizer(spec, ["some text"])


def test_bpe_needs_texts_and_json_must_parse(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no texts"):
        load_tokenizer("bpe:300")
    bad = tmp_path / "bad.json"
    bad.write_text("{not a tokenizer", encoding="utf-8")
    with pytest.raises(DataError, match="cannot read tokenizer file"):
        load_tokenizer(str(bad))


# --------------------------------------------------------------------------- sources


def test_builtin_stdlib_excludes_tests_and_is_deterministic() -> None:
    def head(k: int) -> list[str]:
        texts = iter_source_texts("builtin:python-stdlib")
        return [next(texts) for _ in range(k)]

    assert head(40) == head(40)
    # The same files as an independent selection by the documented rules (order aside).
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "dist-packages", "test", "tests", "idle_test"}
    expected = [
        path.read_text(encoding="utf-8", errors="replace")
        for path in stdlib.rglob("*.py")
        if not path.name.startswith("test_")
        and not any(
            p in skipped or p.startswith("test") for p in path.relative_to(stdlib).parts[:-1]
        )
    ]
    texts = list(iter_source_texts("builtin:python-stdlib"))
    assert sorted(texts) == sorted(t for t in expected if t)
    # Top-level modules come first, in sorted order, e.g. __future__.py before abc.py.
    future = (stdlib / "__future__.py").read_text(encoding="utf-8")
    abc = (stdlib / "abc.py").read_text(encoding="utf-8")
    assert texts.index(future) < texts.index(abc) < 100


def test_local_txt_directory_sorted_and_filtered(text_dir: Path) -> None:
    texts = list(iter_source_texts(str(text_dir)))
    # os.walk order, each level sorted: doc00..doc11, then b_sub/code.py and b_sub/notes.md;
    # .hidden/ and image.png are skipped.
    assert [t.split("\n")[0] for t in texts[:12]] == [f"# doc {i}" for i in range(12)]
    assert texts[12:] == [ASCII_SAMPLE, "markdown notes, nested\n"]
    assert list(iter_source_texts(str(text_dir / "b_sub" / "notes.md"))) == [texts[13]]


def test_jsonl_json_and_parquet_files(tmp_path: Path) -> None:
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"id": i, "text": f"line {i}"}) + "\n" for i in range(5)),
        encoding="utf-8",
    )
    plain_json = tmp_path / "b.json"
    plain_json.write_text(
        json.dumps([{"text": "x"}, {"text": ""}, {"text": "y"}]), encoding="utf-8"
    )
    parquet = tmp_path / "c.parquet"
    datasets.Dataset.from_dict({"text": ["p", "q", "r"], "n": [1, 2, 3]}).to_parquet(str(parquet))

    assert list(iter_source_texts(str(jsonl))) == [f"line {i}" for i in range(5)]
    assert list(iter_source_texts(str(plain_json))) == ["x", "y"]  # empty documents skipped
    assert list(iter_source_texts(str(parquet))) == ["p", "q", "r"]
    assert list(iter_source_texts(str(tmp_path))) == [
        *(f"line {i}" for i in range(5)),
        "x",
        "y",
        "p",
        "q",
        "r",
    ]


def test_bad_sources_raise_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data path not found"):
        iter_source_texts(str(tmp_path / "nope" / "corpus.txt"))
    with pytest.raises(DataError, match="data path not found"):
        iter_source_texts("corpus.jsonl")  # a bare file name is a path, not a hub dataset
    with pytest.raises(DataError, match="python-stdlib"):
        iter_source_texts("builtin:wikipedia")
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(DataError, match="no text"):
        list(iter_source_texts(str(empty)))
    only_unsupported = tmp_path / "unsupported"
    only_unsupported.mkdir()
    (only_unsupported / "table.csv").write_text("a,b\n", encoding="utf-8")
    with pytest.raises(DataError, match="no text"):
        list(iter_source_texts(str(only_unsupported)))
    no_field = tmp_path / "records.jsonl"
    no_field.write_text('{"content": "abc"}\n', encoding="utf-8")
    with pytest.raises(DataError, match="no 'text' field"):
        list(iter_source_texts(str(no_field)))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n", encoding="utf-8")
    with pytest.raises(DataError, match="cannot load"):
        list(iter_source_texts(str(broken)))
    with pytest.raises(DataError, match="unsupported data file"):
        iter_source_texts(str(only_unsupported / "table.csv"))


@pytest.mark.parametrize("source", ["someorg/no-such-dataset", "hf:no-such-dataset:cfg"])
def test_unreachable_hub_dataset_raises_quickly(
    source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # datasets and huggingface_hub read the offline flags at import time, so set both forms.
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(DataError, match="cannot load dataset source"):
        list(iter_source_texts(source))
    assert time.monotonic() - start < 10


# --------------------------------------------------------------------------- datasets


def test_build_dataset_builtin_split_is_disjoint_and_deterministic() -> None:
    def build(seed: int) -> TokenDataset:
        return build_dataset(
            "builtin:python-stdlib", "bytes", 127, 50, max_tokens=200_000, seed=seed
        )

    data, again = build(3), build(3)
    n = 200_000 // 128
    assert data.train.dtype == data.val.dtype == torch.int64
    assert data.train.shape == (n - 50, 128) and data.val.shape == (50, 128)
    assert data.vocab_size == 256 and isinstance(data.tokenizer, ByteTokenizer)
    assert torch.equal(data.train, again.train) and torch.equal(data.val, again.val)

    # Windows are consecutive slices of the documents joined by blank lines; the seeded choice of
    # val slots goes to val, every other slot to train, both in stream order.
    text = "\n\n".join(iter_source_texts("builtin:python-stdlib"))
    stream = torch.frombuffer(bytearray(text.encode("utf-8")[:200_000]), dtype=torch.uint8)
    slots = stream[: n * 128].long().view(n, 128)
    val_slots = torch.randperm(n, generator=torch.Generator().manual_seed(3))[:50].sort().values
    is_val = torch.zeros(n, dtype=torch.bool)
    is_val[val_slots] = True
    assert torch.equal(data.val, slots[val_slots]) and torch.equal(data.train, slots[~is_val])

    other = build(4)
    assert not torch.equal(other.val, data.val)


def test_build_dataset_bpe_on_local_text(text_dir: Path) -> None:
    data = build_dataset(str(text_dir), "bpe:300", seq_len=32, val_sequences=4, seed=0)
    assert 256 < data.vocab_size <= 300
    assert data.train.shape[1] == data.val.shape[1] == 33 and len(data.val) == 4
    assert int(data.train.max()) < data.vocab_size
    # Packed windows decode back to text of the corpus (documents joined by a blank line).
    corpus = "\n\n".join(iter_source_texts(str(text_dir)))
    assert data.tokenizer.decode(data.train[0].tolist()) in corpus


def test_build_dataset_too_small_says_how_many_tokens() -> None:
    with pytest.raises(DataError, match="need 1280 tokens"):
        build_dataset("builtin:python-stdlib", "bytes", 127, 9, max_tokens=1000)
    with pytest.raises(DataError, match="seq_len"):
        build_dataset("builtin:python-stdlib", "bytes", 0, 9)


# --------------------------------------------------------------------------- shards


def test_iid_shards_partition_exactly() -> None:
    shards = iid_shards(103, 4, seed=7)
    assert [len(s) for s in shards] == [26, 26, 26, 25]
    assert all(s.dtype == torch.int64 and torch.equal(s, s.sort().values) for s in shards)
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(103))
    assert all(torch.equal(a, b) for a, b in zip(shards, iid_shards(103, 4, seed=7), strict=True))
    assert not torch.equal(shards[0], iid_shards(103, 4, seed=8)[0])
    with pytest.raises(DataError):
        iid_shards(3, 4, seed=0)


def test_kmeans_recovers_separated_blobs_deterministically() -> None:
    generator = torch.Generator().manual_seed(0)
    centres = torch.tensor([[0.0, 0.0, 0.0], [20.0, 0.0, 5.0], [0.0, 20.0, -5.0], [15, 15, 15]])
    sizes = [40, 25, 60, 10]
    labels = torch.cat([torch.full((s,), i) for i, s in enumerate(sizes)])
    points = centres[labels] + torch.randn(len(labels), 3, generator=generator)
    order = torch.randperm(len(labels), generator=generator)
    points, labels = points[order], labels[order]

    shards = kmeans_shards(points, 4, seed=1)
    assert sorted(len(s) for s in shards) == sorted(sizes)
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(len(labels)))
    for shard in shards:
        assert torch.equal(shard, shard.sort().values)
        assert len(set(labels[shard].tolist())) == 1  # each shard is exactly one blob
    again = kmeans_shards(points, 4, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(shards, again, strict=True))


def test_kmeans_keeps_every_shard_non_empty() -> None:
    # Only two distinct points but three clusters: one must be filled by re-seeding.
    points = torch.tensor([[0.0, 0.0]] * 5 + [[1.0, 1.0]] * 5)
    shards = kmeans_shards(points, 3, seed=0)
    assert all(len(s) > 0 for s in shards)
    assert torch.equal(torch.cat(shards).sort().values, torch.arange(10))


def test_sequence_features_shape_and_mode() -> None:
    model = build_model("nano", vocab_size=256, seed=0)
    model.train()
    sequences = torch.randint(0, 256, (10, 17), generator=torch.Generator().manual_seed(0))
    features = sequence_features(model, sequences, batch_size=4)
    assert features.shape == (10, 96) and features.dtype == torch.float32
    assert model.training
    expected = model.eval().hidden_states(sequences[:3, :-1]).mean(dim=1)
    assert torch.allclose(features[:3], expected, atol=1e-5)


# --------------------------------------------------------------------------- streams


def _stream() -> ShardStream:
    data = torch.arange(40 * 5).view(40, 5)
    indices = torch.tensor([1, 3, 4, 8, 9, 15, 16, 22, 23, 30, 31])  # 11 samples
    return ShardStream(data, indices, batch_size=4, seed=5)


def test_shard_stream_resume_matches_uninterrupted_run() -> None:
    reference = _stream()
    expected = [reference.next_batch() for _ in range(14)]

    first = _stream()
    for _ in range(7):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"epoch": 2, "position": 6} and first.samples_seen == 28

    resumed = _stream()
    resumed.load_state_dict(state)
    # Batches 8..14 span the epoch boundary between epochs 2 and 3 (samples 33 and 44).
    for want in expected[7:]:
        assert torch.equal(resumed.next_batch(), want)
    assert resumed.samples_seen == reference.samples_seen == 56


def test_shard_stream_visits_each_sample_once_per_epoch() -> None:
    stream = _stream()
    rows = torch.cat([stream.next_batch() for _ in range(11)])  # 44 samples = 4 epochs
    ids = (rows[:, 0] // 5).view(4, 11)
    shard = [1, 3, 4, 8, 9, 15, 16, 22, 23, 30, 31]
    for epoch in ids:
        assert sorted(epoch.tolist()) == shard
    assert not torch.equal(ids[0], ids[1])  # reshuffled between epochs
    # The documented order, which other peers reproduce: randperm seeded seed * 1_000_003 + e.
    for epoch in range(4):
        generator = torch.Generator().manual_seed(5 * 1_000_003 + epoch)
        assert ids[epoch].tolist() == [shard[i] for i in torch.randperm(11, generator=generator)]


@pytest.mark.parametrize(
    "state",
    [
        {"epoch": 0},
        {"epoch": -1, "position": 0},
        {"epoch": 0, "position": 11},
        {"epoch": 0, "position": 2.0},
        {"epoch": True, "position": 0},
        {"epoch": 0, "position": 0, "extra": 1},
    ],
)
def test_shard_stream_rejects_bad_state(state: dict[str, int]) -> None:
    with pytest.raises(DataError):
        _stream().load_state_dict(state)


def test_shard_stream_batch_larger_than_shard_spans_epochs() -> None:
    data = torch.arange(40 * 5).view(40, 5)
    stream = ShardStream(data, torch.tensor([2, 5, 7]), batch_size=8, seed=0)
    ids = torch.cat([stream.next_batch(), stream.next_batch()])[:, 0] // 5  # 16 samples
    assert all(sorted(epoch.tolist()) == [2, 5, 7] for epoch in ids[:15].view(5, 3))
    assert stream.state_dict() == {"epoch": 5, "position": 1} and stream.samples_seen == 16
