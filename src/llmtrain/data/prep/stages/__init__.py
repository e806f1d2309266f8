"""Staged deduplication: ``prepare --dedup`` as stages of independent tasks with bounded memory each.

The in-memory :class:`~llmtrain.data.prep.dedup.DedupIndex` holds ~1.5 KB per kept document in one process.
Here the same decisions (same MinHash signatures, band keys and verification, from ``dedup``) are split into
stages whose tasks each touch a bounded slice of the corpus, with files in a work folder between them::

    1 screen      per partition: read, clean, filter; exact digest and MinHash band keys, bucketed on disk by a
                  hash of the key (B buckets); the kept texts and signatures          (stages/screen.py)
    2 pairs       per bucket: equal keys -> candidate pairs, verified by estimated Jaccard (stages/pairs.py)
    3 components  connected components of the pairs; in each, the lowest global document id survives; memory
                  grows with the duplicates only                                       (stages/components.py)
    4 tokenize    per partition: drop, tokenize, write a part                         (stages/tokenize.py)
    5 write       assemble the parts into shards + manifest (``shards.write_dataset``) (stages/run.py)

Modules: ``layout`` (the plan of partitions and buckets, document ids, the work folder, task markers),
``tasks`` (one task of any stage, timed, with its peak memory, its marker written last), ``engines`` (local
processes or Ray tasks), ``run`` (the stages in order, progress, the report), ``plan`` (``prepare --plan``:
capacity estimate). A document's id is ``file << 40 | line``: its place in the input order, the same for any
partitioning, so the output is byte-identical for any number of partitions, buckets, workers, or engine.
Design and trade-offs: docs/data.md, "Staged deduplication". Nothing is imported here.
"""
