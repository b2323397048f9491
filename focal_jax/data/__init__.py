"""Data for training and evaluation: sources, tokenizers (SentencePiece or Hugging Face tokenizer.json), packing,
synthetic tasks, grain pipelines.

    data = build_data(DataConfig(source='builtin', seq_len=128), global_batch=32, seed=0)
    it = train_iterator(data)            # it.get_state() / it.set_state(state): {'next_index': step}
    batch = next(it)                     # dict of [32 // process_count, 128] arrays, keys as `pack`
    eval_batches = data.eval_batches(4)  # held-out, deterministic

Paper-scale corpora stream instead of loading (`focal_jax.data.streaming`): the same call with
`DataConfig(source='jsonl', paths='corpus/*.jsonl', streaming=True, tokenizer=...)`; `it.get_state()` is then a few
integers per reader, and `data.n_train_rows` / `n_train_tokens` are None.
"""

from focal_jax.data.config import DataConfig
from focal_jax.data.corpus import builtin_corpus
from focal_jax.data.packing import merge_documents, pack
from focal_jax.data.pipeline import Data, build_data, encode_documents, train_iterator
from focal_jax.data.sources import read_documents
from focal_jax.data.synthetic import Example, make_examples, score
from focal_jax.data.tokenizer import (Tokenizer, cached_tokenizer, copy_tokenizer, load_tokenizer, tokenizer_file,
                                      train_tokenizer, workdir_tokenizer)

__all__ = [
    "Data", "DataConfig", "Example", "Tokenizer", "build_data", "builtin_corpus", "cached_tokenizer",
    "copy_tokenizer", "encode_documents", "load_tokenizer", "make_examples", "merge_documents", "pack",
    "read_documents", "score", "tokenizer_file", "train_iterator", "train_tokenizer", "workdir_tokenizer",
]
