"""The run's data sources, opened: a prepared directory (``q38.train.data.shards``), a Megatron corpus
(``q38.train.data.megatron``) or a JSONL file, alone or as a weighted mixture with its evaluation split (``TrainData``)."""

from __future__ import annotations

import os
from typing import Any

from q38.train.data.loader import DataError, PackedDataset
from q38.train.data.megatron import MegatronRows, megatron_prefix
from q38.train.data.shards import (
    EvalRows, MixtureIterator, PackedRows, RowSource, ShardRows, _Slice, is_prepared, parse_mixture,
)
from q38.train.data.tokenizer import Tokenizer


def open_source(path: str, tok: Tokenizer, seq_len: int, vocab_size: int, overlong: str,
                train_on: str = "assistant") -> RowSource:
    """A prepared directory -> ``ShardRows``; a Megatron prefix (``PREFIX.bin`` + ``PREFIX.idx``) -> ``MegatronRows``;
    a JSONL file or ``builtin:NAME`` -> ``PackedRows`` (tokenized now)."""
    from q38.train.data.loader import build_dataset
    if (prefix := megatron_prefix(path)) is not None:
        return MegatronRows(prefix, seq_len, tokenizer=tok, vocab_size=vocab_size)
    if is_prepared(path):
        return ShardRows(path, seq_len, tokenizer=tok, vocab_size=vocab_size, train_on=train_on)
    ds = build_dataset(path, tok, seq_len, overlong=overlong, train_on=train_on)
    if ds.num_targets == 0:
        raise DataError(f"data: {path} has no trainable tokens (every token is masked under data.train_on: "
                        f"{train_on}: chat records without assistant turns?); add text records or assistant "
                        f"replies, or set data.train_on: all")
    return PackedRows(ds, path)


def _subset(ds: PackedDataset, start: int, stop: int) -> PackedDataset:
    out = object.__new__(PackedDataset)
    out.input_ids, out.labels, out.doc_ids = (t[start:stop] for t in (ds.input_ids, ds.labels, ds.doc_ids))
    return out


class TrainData:
    """The run's opened data (every file checked, nothing read beyond manifests for shards): train sources with
    weights, and the eval sources. ``iterators`` makes this rank's train and eval iterators."""

    def __init__(self, path: Any, tok: Tokenizer, *, seq_len: int, vocab_size: int, overlong: str = "truncate",
                 eval_split: float = 0.0, eval_path: str | None = None, train_on: str = "assistant") -> None:
        mix = parse_mixture(path)
        # one JSONL file: data.BatchIterator as before
        self.legacy = len(mix) == 1 and not is_prepared(mix[0][0]) and megatron_prefix(mix[0][0]) is None
        opened = [open_source(p, tok, seq_len, vocab_size, overlong, train_on) for p, _ in mix]
        self.weights = [w for _, w in mix]
        self.eval: list[RowSource] = []
        if eval_path is not None:
            self.eval = [open_source(os.fspath(eval_path), tok, seq_len, vocab_size, overlong, train_on)]
            self.train = opened
        elif eval_split > 0:
            parts = [s.split(eval_split) for s in opened]
            self.train, self.eval = [t for t, _ in parts], [e for _, e in parts]
        else:
            self.train = opened

    def iterators(self, batch_size: int, *, dp_rank: int, dp_size: int, seed: int, shuffle: bool,
                  eval_batches: int = 0, eval_batch_size: int | None = None):
        from q38.train.data.loader import BatchIterator

        if self.legacy:
            src = self.train[0]
            ds = src.base.dataset if isinstance(src, _Slice) else src.dataset
            if isinstance(src, _Slice):
                ds = _subset(ds, src.start, src.stop)
            train = BatchIterator(ds, batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=seed, shuffle=shuffle)
        else:
            train = MixtureIterator(self.train, self.weights, batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                    seed=seed, shuffle=shuffle)
        ev = EvalRows(self.eval, eval_batch_size or batch_size, dp_rank=dp_rank, dp_size=dp_size, max_batches=eval_batches) \
            if self.eval else None
        return train, ev
