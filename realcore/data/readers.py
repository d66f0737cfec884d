"""Rows of the file formats users bring: jsonl, parquet, and a folder written by HF `datasets`'
`save_to_disk` (a Dataset, or a DatasetDict with its splits).

A reader yields `(index, row)` for the rows a data-parallel rank owns (`index % world == rank`,
the index counting every row of the source, so which rows a rank owns never depends on which are
skipped); a row is a mapping, or the reason it is skipped when that is known while reading (bad
JSON). `read(cfg, 0, 1)` reads the whole source (the missing-key check of realcore.data.datasets).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping

from realcore.api.config import DatasetConfig

SKIP_BAD_JSON = "bad json"

Rows = Iterator[tuple[int, "Mapping | str"]]


def source_path(cfg: DatasetConfig, *, folder: bool = False) -> str:
    """`dataset.path`, expanded and checked: a readable file (or a folder), else a one-line error."""
    if cfg.path is None:
        raise ValueError(f"dataset.path: required for dataset.type={cfg.type}")
    path = os.path.expanduser(cfg.path)
    if folder and not os.path.isdir(path):
        raise ValueError(f"dataset.path: no such folder {cfg.path!r} (type={cfg.type}: the folder "
                         "datasets' save_to_disk wrote)")
    if not folder and not os.path.isfile(path):
        raise ValueError(f"dataset.path: no such file {cfg.path!r}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"dataset.path: cannot read {cfg.path!r} (permission denied)")
    return path


def jsonl_rows(cfg: DatasetConfig, rank: int, world: int) -> Rows:
    """A jsonl file; only the owned lines are parsed; the index counts non-blank lines."""
    with open(source_path(cfg), "rb") as f:  # bytes: a line with invalid UTF-8 is one bad row, not a crash
        lines = (line for line in f if line.strip())
        for i, line in enumerate(lines):
            if i % world != rank:
                continue
            try:
                row = json.loads(line)
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                yield i, SKIP_BAD_JSON
                continue
            yield i, row if isinstance(row, dict) else SKIP_BAD_JSON


def parquet_rows(cfg: DatasetConfig, rank: int, world: int) -> Rows:
    """A parquet file, read a batch of rows at a time (its columns are the row's keys)."""
    import pyarrow.parquet as pq  # heavy: only for this format

    path = source_path(cfg)
    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and friends: not a parquet file
        raise ValueError(f"dataset.path: {cfg.path!r} is not a parquet file: {' '.join(str(e).split())}") from None
    start = 0  # the index of the batch's first row
    for batch in f.iter_batches(batch_size=1024):
        owned = [j for j in range(batch.num_rows) if (start + j) % world == rank]
        for j, row in zip(owned, batch.take(owned).to_pylist()):  # only the owned rows become Python objects
            yield start + j, row
        start += batch.num_rows


def hf_rows(cfg: DatasetConfig, rank: int, world: int) -> Rows:
    """A folder written by `Dataset.save_to_disk` (or `DatasetDict.save_to_disk`: `dataset.split`
    names the split; a folder of one split needs none)."""
    import datasets  # heavy: only for this format

    path = source_path(cfg, folder=True)
    try:
        ds = datasets.load_from_disk(path)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"dataset.path: {cfg.path!r} is not a folder written by datasets' save_to_disk: "
                         f"{' '.join(str(e).split())}") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if cfg.split is None and len(splits) != 1:
            raise ValueError(f"dataset.split: {cfg.path!r} holds the splits {', '.join(splits)}: name one")
        split = cfg.split if cfg.split is not None else splits[0]
        if split not in ds:
            raise ValueError(f"dataset.split: no split {split!r} in {cfg.path!r} (splits: {', '.join(splits)})")
        ds = ds[split]
    elif cfg.split is not None:
        raise ValueError(f"dataset.split: {cfg.path!r} holds one Dataset, not a DatasetDict of splits; drop dataset.split")
    owned = range(rank, len(ds), world)
    for i, row in zip(owned, ds.select(owned)):
        yield i, row
