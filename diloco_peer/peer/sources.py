"""Text sources: the documents of a run's `data` source, in a deterministic order, so that
every peer that reads the same source packs the same token windows (data.py).

`datasets` is imported lazily: it costs about a second and only json/parquet/hub sources need it.
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from diloco_peer.errors import DataError

BUILTIN_SOURCES = ("builtin:python-stdlib",)
"""The sources this package carries (`builtin:NAME`), readable without files or network."""
_PLAIN_SUFFIXES = (".txt", ".md", ".py")
_RECORD_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}  # -> datasets builder
_SUFFIXES = (*_PLAIN_SUFFIXES, *_RECORD_SUFFIXES)
_HUB_NAME = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def iter_source_texts(source: str) -> Iterator[str]:
    """Documents of a source, in a deterministic order; empty documents are skipped.

    Forms: "builtin:python-stdlib"; a local file or directory (.txt/.md/.py read whole,
    .json/.jsonl field "text", .parquet column "text"); "hf:NAME[:CONFIG]" or a bare hub name
    such as "org/name" (streamed, split "train", field "text"). The form and local paths are
    checked here; files are read while iterating. A source with no text raises `DataError`.
    """
    texts: Iterator[str]
    if source.startswith("builtin:"):
        if source not in BUILTIN_SOURCES:
            raise DataError(
                f"unknown builtin source {source!r}; available: {', '.join(BUILTIN_SOURCES)}"
            )
        texts = _stdlib_texts()
    elif source.startswith("hf:"):
        name, _, config = source.removeprefix("hf:").partition(":")
        if not name or ":" in config:
            raise DataError(f"bad hub source {source!r}; expected 'hf:NAME' or 'hf:NAME:CONFIG'")
        texts = _record_texts(f"dataset source {source}", name, config or None)
    elif Path(source).expanduser().exists():
        texts = _local_texts(Path(source).expanduser())
    elif is_hub_name(source):
        texts = _record_texts(f"dataset source {source}", source)
    else:
        raise DataError(f"data path not found: {source}")
    return _require_text(texts, source)


def is_hub_name(source: str) -> bool:
    """Whether `source` has the form of a bare datasets-hub name ("name" or "org/name", no
    data-file suffix): `iter_source_texts` streams it from the hub unless it is a local path."""
    return bool(_HUB_NAME.match(source)) and Path(source).suffix.lower() not in _SUFFIXES


def _require_text(texts: Iterator[str], source: str) -> Iterator[str]:
    found = False
    for text in texts:
        if text:
            found = True
            yield text
    if not found:
        raise DataError(
            f"data source {source!r} yielded no text (files read: {', '.join(_SUFFIXES)})"
        )


def _sorted_walk(root: Path, skip_dir: Callable[[str], bool]) -> Iterator[Path]:
    """Files under `root`, directories and files each visited in sorted order."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not skip_dir(d))
        yield from (Path(dirpath) / filename for filename in sorted(filenames))


def _stdlib_texts() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _sorted_walk(root, lambda d: d in _SKIPPED_STDLIB_DIRS or d.startswith("test")):
        if path.suffix == ".py" and not path.name.startswith("test_"):
            yield _read_plain(path)


def _local_texts(path: Path) -> Iterator[str]:
    if not path.is_file():
        # Hidden directories (.git, .cache) hold no corpus; other file types are skipped.
        return _read_local_files(_sorted_walk(path, lambda d: d.startswith(".")))
    if path.suffix.lower() not in _SUFFIXES:
        raise DataError(f"unsupported data file {path}; expected one of {', '.join(_SUFFIXES)}")
    return _read_local_files([path])


def _read_local_files(files: Iterable[Path]) -> Iterator[str]:
    for file in files:
        suffix = file.suffix.lower()
        if suffix in _PLAIN_SUFFIXES:
            yield _read_plain(file)
        elif suffix in _RECORD_SUFFIXES:
            # Streaming reads the file in batches and writes no Arrow cache.
            yield from _record_texts(str(file), _RECORD_SUFFIXES[suffix], data_files=str(file))


def _read_plain(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None


def _record_texts(what: str, *args: Any, **kwargs: Any) -> Iterator[str]:
    """Field "text" of `datasets.load_dataset(*args, **kwargs)`, failures as `DataError`."""
    import datasets

    try:
        for record in datasets.load_dataset(*args, split="train", streaming=True, **kwargs):
            text = record.get("text")
            if text is None and "text" not in record:
                raise DataError(f"{what}: records have no 'text' field (fields: {list(record)})")
            if text is not None and not isinstance(text, str):
                raise DataError(f"{what}: field 'text' holds {type(text).__name__}, not a string")
            if text:
                yield text
    except DataError:
        raise
    except Exception as exc:  # datasets fails with many types (OSError, ArrowInvalid, ...)
        raise DataError(f"cannot load {what}: {short_error(exc)}") from None


def short_error(exc: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
