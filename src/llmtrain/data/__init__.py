"""The data path: raw text -> tokens on disk -> a deterministic, resumable stream of batches.

Modules, in the order data flows through them:

* ``readers``   expand ``--input`` paths and stream documents out of jsonl / txt / parquet (.gz, .zst) files;
* ``clean``     Unicode normalization, control characters, whitespace, mojibake repair;
* ``filters``   Gopher quality and repetition filters, C4 line rules (CJK measured in characters);
* ``dedup``     exact and MinHash-LSH near-duplicate detection;
* ``tokenizer`` one :class:`Tokenizer` over HF ``tokenizers`` and SentencePiece, and deterministic BPE training;
* ``pipeline``  the per-document worker stages and :class:`PrepareOptions` (the ``data.prepare`` section);
* ``pack``      concat and best-fit-decreasing packing with truncation / padding statistics;
* ``indexed``   Megatron-LM compatible ``.bin/.idx`` writer and memory-mapped reader;
* ``manifest``  ``PREFIX.manifest.json`` (tokenizer, shards, checksums, report) that makes a dataset self-contained;
* ``shards``    resumable intermediate parts, and the final shards + manifest + report;
* ``prepare``   the ``llmtrain prepare`` command tying the above together, atomically and resumably;
* ``merge``     ``llmtrain merge``: join ``--partition`` outputs with cross-partition dedup;
* ``samples``   token windows over a split and the weighted, infinite blend (Megatron's GPTDataset semantics);
* ``loader``    ``build_datasets(cfg)`` and the stateful, DP-layout-independent :class:`BatchIterator`.

Only the light, torch-free pieces are imported here; import ``llmtrain.data.loader`` (torch) and
``llmtrain.data.prepare`` explicitly.
"""

from llmtrain.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from llmtrain.data.manifest import manifest_path, read_manifest, tokenizer_path
from llmtrain.data.tokenizer import Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "IndexedDataset",
    "IndexedDatasetWriter",
    "Tokenizer",
    "load_tokenizer",
    "manifest_path",
    "optimal_dtype",
    "read_manifest",
    "tokenizer_path",
    "train_bpe",
]
