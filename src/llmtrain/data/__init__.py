"""The data path: raw text -> tokens on disk -> a deterministic, resumable stream of batches.

Two halves, so that training never imports the offline tools. Runtime (this package: what ``train``,
``generate`` and ``check`` read):

* ``indexed``   Megatron-LM compatible ``.bin/.idx`` writer and memory-mapped reader (the on-disk format);
* ``manifest``  ``PREFIX.manifest.json`` (tokenizer, shards, checksums, report) that makes a dataset self-contained;
* ``describe``  what a prefix is: its manifest, or a plain Megatron ``.bin/.idx`` read with ``data.tokenizer``;
* ``verify``    sha256 of the files against the manifest (once, then a stamp) and token ids against the vocabulary;
* ``tokenizer`` one :class:`Tokenizer` over HF ``tokenizers`` and SentencePiece: load, encode, decode;
* ``samples``   token windows over a split and the weighted, infinite blend (Megatron's GPTDataset semantics);
* ``loader``    ``build_datasets(cfg)`` and the stateful, DP-layout-independent :class:`BatchIterator`.

Offline preparation (``llmtrain.data.prep``: ``llmtrain prepare`` and ``llmtrain merge``, which write the
format above): read, clean, filter, dedup, tokenize, pack, write; see that package's docstring. It imports
the runtime modules for the format; nothing here imports it.

Only the light, torch-free pieces are imported here; import ``llmtrain.data.loader`` (torch) and
``llmtrain.data.prep.prepare`` explicitly.
"""

from llmtrain.data.indexed import IndexedDataset, IndexedDatasetWriter, optimal_dtype
from llmtrain.data.manifest import manifest_path, read_manifest, tokenizer_path
from llmtrain.data.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "IndexedDataset",
    "IndexedDatasetWriter",
    "Tokenizer",
    "load_tokenizer",
    "manifest_path",
    "optimal_dtype",
    "read_manifest",
    "tokenizer_path",
]
