"""Offline data preparation: raw text -> cleaned, filtered, deduplicated, tokenized, packed token shards.

``llmtrain prepare`` (``prepare``) and ``llmtrain merge`` (``merge``). Modules, in the order data flows:

* ``readers``    expand ``--input`` paths and stream documents out of jsonl / txt / parquet (.gz, .zst) files;
* ``clean``      Unicode normalization, control characters, whitespace, mojibake repair;
* ``textarrays``   character classes and text-as-array helpers shared by ``filters``, ``filters_batch``, ``dedup``;
* ``filters``    Gopher quality and repetition filters, C4 line rules (CJK measured in characters), per document;
* ``filters_batch``  the same rules over a chunk of documents at once (what ``prepare`` runs);
* ``dedup``      exact and MinHash-LSH near-duplicate detection;
* ``pipeline``   the per-document worker stages and :class:`PrepareOptions` (the ``data.prepare`` section);
* ``job``        :class:`PrepareJob` (one run, immutable) and :class:`PartCounters` (what a part counts);
* ``parts``      the document loop: chunks, worker pool, dedup decisions, one finished part per input file;
* ``pack``       concat and best-fit-decreasing packing with truncation / padding statistics;
* ``shards``     resumable intermediate parts, and the final shards + manifest + report;
* ``tokenizer_training``  deterministic byte-level BPE training (``--train-tokenizer``);
* ``prepare``    ``llmtrain prepare``'s algorithm, tying the above together, atomically and resumably;
* ``merge``      ``llmtrain merge``'s algorithm: join ``--partition`` outputs with cross-partition dedup.

The two commands' flags are in :mod:`llmtrain.commands.prepare` and :mod:`llmtrain.commands.merge`.

The output format and its readers (``indexed``, ``manifest``, ``tokenizer``, ``samples``, ``loader``) are the
runtime half, in :mod:`llmtrain.data`; modules here import them, never the other way round. Nothing is
imported here: import the module you need.
"""
