"""The staged dedup (data/prep/stages): byte-identical output for one process, 2 local workers, 2 Ray workers,
4 partitions x 8 buckets and sliced files, on a corpus with planted exact and near duplicates spread across
files; the kept documents against the planting's ground truth (lowest id survives) and the tokens against an
independent .bin/.idx reader; near_pairs' recall / false positives on planted signatures; components against a
plain union-find; resume of scheduled and killed runs; bad input on every engine (the CLI on Ray: exit 2,
nothing written, skips counted); report.txt's staged section against the manifest and the planting; the plan;
the CLI."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from conftest import read_megatron
from llmtrain.cli import main as cli
from llmtrain.data.prep.clean import clean_text
from llmtrain.data.prep.dedup import (
    DedupConfig,
    DedupIndex,
    MinHasher,
    estimated_jaccard,
    exact_digest,
    jaccard,
)
from llmtrain.data.prep.pipeline import options_from
from llmtrain.data.prep.prepare import prepare
from llmtrain.data.prep.stages import tasks
from llmtrain.data.prep.stages.components import component_minimum
from llmtrain.data.prep.stages.layout import make_plan
from llmtrain.data.prep.stages.pairs import near_pairs
from llmtrain.data.prep.stages.plan import estimate, format_plan
from llmtrain.data.prep.tokenizer_training import train_bpe
from llmtrain.data.tokenizer import load_tokenizer
from llmtrain.errors import ConfigError, DataError

WORDS = ("river stone garden window letter harbor candle meadow silver thunder lantern orchard valley "
         "compass feather marble velvet canyon blossom timber").split()  # fmt: skip
OPTS = {"clean": True, "filter": True, "dedup": "near", "num_shards": 2}


def prose(n_words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), n_words)]
    return " ".join(" ".join(words[i : i + 12]) + "." for i in range(0, n_words, 12))


def edit(text: str, positions: list[int], seed: int) -> str:
    """``text`` with the words at ``positions`` replaced by a word outside the vocabulary."""
    words = text.split(" ")
    for p in positions:
        words[p] = f"zq{seed}x{p}" + ("." if words[p].endswith(".") else "")
    return " ".join(words)


def cjk(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return "".join(chr(0x4E00 + int(c)) for c in rng.integers(0, 300, n)) + "。"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """6 jsonl files; 60 English + 6 Chinese originals, 15 near copies (2 words / 3 characters changed), 10
    exact copies (trailing spaces, CRLF: equal after cleaning), 3 too-short documents; copies in other files,
    some before their original. Returns (folder, tokenizer, inputs, rows: (file, line, text, cluster))."""
    root = tmp_path_factory.mktemp("staged")
    originals = [prose(150 + 3 * i, i) for i in range(60)] + [cjk(300, 100 + i) for i in range(6)]
    files: list[list[tuple[str, int]]] = [[] for _ in range(6)]
    for c, text in enumerate(originals):
        files[c % 6].append((text, c))
    for c in range(0, 66, 5):  # near copies, one file on (file 0 for originals of file 5: before them)
        t = originals[c]
        near = (
            t[:40] + "".join(chr(ord(x) + 1) for x in t[40:43]) + t[43:] if c >= 60 else edit(t, [20, 90], c)
        )
        files[(c + 1) % 6].append((near, c))
    for c in range(0, 60, 6):  # exact copies after cleaning
        files[(c + 3) % 6].append((originals[c] + "  " if c % 12 else originals[c] + "\r\n", c))
    for k in range(3):
        files[2 * k].append(("too short.", -1))
    inputs, rows = [], []
    for k, docs in enumerate(files):
        path = root / f"in{k}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t, _ in docs), encoding="utf-8")
        inputs.append(str(path))
        rows += [(k, line, t, c) for line, (t, c) in enumerate(docs, start=1)]
    tok = root / "bpe.json"
    train_bpe(iter(originals[:30]), 400, str(tok))
    return root, str(tok), inputs, rows


def expected(rows):
    """(kept rows in input order, {reason: count}): per cluster the lowest (file, line) survives; a dropped
    copy is an exact duplicate when a lower-id member has its cleaned text."""
    kept, reasons = [], {"exact_duplicate": 0, "near_duplicate": 0}
    seen: dict[int, list[str]] = {}
    for _, _, text, c in sorted(rows, key=lambda r: (r[0], r[1])):
        if c < 0:
            continue
        cleaned = clean_text(text)
        if c not in seen:
            kept.append(cleaned)
            seen[c] = [cleaned]
            continue
        reasons["exact_duplicate" if cleaned in seen[c] else "near_duplicate"] += 1
        seen[c].append(cleaned)
    return kept, reasons


def shard_hashes(m: dict) -> list[str]:
    return [s["files"][k]["sha256"] for s in m["shards"] for k in ("bin", "idx")]


@pytest.fixture(scope="module")
def reference(corpus):
    """The one-process run (in-process engine, 1 partition x 1 bucket) and its checks against the planting."""
    root, tok, inputs, rows = corpus
    m = prepare(inputs, str(root / "one"), tokenizer=tok, log=None, options=OPTS,
                stages={"partitions": 1, "buckets": 1})  # fmt: skip
    kept, reasons = expected(rows)
    t = load_tokenizer(tok)
    want = [t.encode(x) + [t.eos_id] for x in kept]
    shards = [read_megatron(str(root / s["name"])) for s in m["shards"]]
    got = [shards[i % 2][i // 2] for i in range(sum(map(len, shards)))]  # dealt round-robin
    assert got == want and m["documents"] == len(kept) == 66
    stages = m["report"]["stages"]
    assert stages["dedup"]["removed"] == reasons == {"exact_duplicate": 10, "near_duplicate": 14}
    assert stages["filter"]["removed"] == {"too_short": 3} and stages["read"]["in"] == 93
    assert m["report"]["staged"]["stages"]["components"]["dropped"] == 24
    return m


def test_one_process_matches_planting_and_in_memory_index(corpus, reference):
    root, tok, inputs, rows = corpus
    # the in-memory index, fed in input order, keeps the same documents here (every cluster is a clique)
    mh, index = MinHasher(DedupConfig()), DedupIndex(DedupConfig())
    kept = []
    for _, _, text, c in sorted(rows, key=lambda r: (r[0], r[1])):
        cleaned = clean_text(text)
        if c >= 0 and index.check(exact_digest(cleaned), *mh.signature(cleaned)) is None:
            kept.append(cleaned)
    assert kept == expected(rows)[0]


@pytest.mark.parametrize(
    "workers, stages",
    [(2, None), (2, {"partitions": 4, "buckets": 8}), (1, {"partitions": 9, "buckets": 3})],
    ids=["local-2-workers", "4-partitions-x-8-buckets", "sliced-files"],
)
def test_same_bytes_for_any_layout(corpus, reference, workers, stages):
    root, tok, inputs, _ = corpus
    out = root / f"o{workers}-{len(stages or {})}-{(stages or {}).get('partitions')}"
    m = prepare(inputs, str(out), tokenizer=tok, log=None, options=OPTS, workers=workers, stages=stages)
    assert shard_hashes(m) == shard_hashes(reference)
    assert m["report"]["stages"] == reference["report"]["stages"]
    staged = m["report"]["staged"]
    assert staged["partitions"] == (stages or {}).get("partitions", 6)
    assert all(v > 0 for s in staged["stages"].values() for v in s["peak_rss_mb"])
    assert not (root / f".{out.name}.work").exists()


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


def test_ray_engine_same_bytes_and_errors(corpus, reference, ray_local, tmp_path):
    root, tok, inputs, _ = corpus
    m = prepare(inputs, str(tmp_path / "ray"), tokenizer=tok, log=None, options=OPTS, workers=2,
                stages={"engine": "ray"})  # fmt: skip
    assert shard_hashes(m) == shard_hashes(reference)
    assert m["report"]["staged"]["engine"] == "ray" and m["documents"] == 66
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine words here"}\n{"text": "x"}\n{broken\n', encoding="utf-8")
    with pytest.raises(DataError, match="bad.jsonl' line 3 is not valid JSON"):
        prepare([*inputs, str(bad)], str(tmp_path / "bad"), tokenizer=tok, log=None, options=OPTS, workers=2,
                stages={"engine": "ray"})  # fmt: skip
    assert not (tmp_path / ".bad.work").exists() and not (tmp_path / "bad.manifest.json").exists()


def planted_signatures(target: float, n: int, seed: int):
    """Band keys and 16-bit signatures of n pairs of shingle sets of Jaccard ~target (rows 2i, 2i + 1)."""
    cfg = DedupConfig()
    mh, rng = MinHasher(cfg), np.random.default_rng(seed)
    bands, sigs, sims = [], [], []
    for _ in range(n):
        a = rng.choice(2**32, 200, replace=False).astype(np.uint64)
        keep = int(round(2 * 200 * target / (1 + target)))
        b = np.concatenate([a[:keep], rng.choice(2**32, 200 - keep).astype(np.uint64)])
        for s in (np.unique(a), np.unique(b)):
            sig = mh.signature_of(s)
            bands.append(mh.band_keys(sig))
            sigs.append((sig & 0xFFFF).astype(np.uint16))
        sims.append(jaccard(np.unique(a), np.unique(b)))
    return np.stack(bands), np.stack(sigs), float(np.mean(sims))


def found_share(target: float, n: int, seed: int) -> tuple[float, float, int]:
    bands, sigs, sim = planted_signatures(target, n, seed)
    doc = np.repeat(np.arange(len(bands)), bands.shape[1])  # [R] the document of each band row
    a, b, _ = near_pairs(bands.reshape(-1).view(np.int64), doc, lambda r: sigs[doc[r]], 0.7)
    pairs = {(int(x), int(y)) for x, y in zip(doc[a], doc[b])}
    planted = sum((2 * i, 2 * i + 1) in pairs for i in range(n))
    return planted / n, sim, len(pairs) - planted


def test_near_pairs_recall_and_false_positives():
    recall, sim, stray = found_share(0.8, 400, 0)
    assert sim >= 0.79 and recall >= 0.9 and stray == 0, (recall, sim, stray)
    fp, sim, stray = found_share(0.45, 400, 1)
    assert sim < 0.5 and fp <= 0.01 and stray == 0, (fp, sim)
    assert found_share(0.2, 200, 2)[0] == 0.0


def test_components_against_union_find():
    rng = np.random.default_rng(3)
    for n, e in ((50, 30), (400, 600), (1000, 200)):
        a, b = rng.integers(0, n, e), rng.integers(0, n, e)
        parent = list(range(n))

        def find(x, parent=parent):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for x, y in zip(a.tolist(), b.tolist()):
            rx, ry = find(x), find(y)
            parent[max(rx, ry)] = min(rx, ry)
        want = [min(i for i in range(n) if find(i) == find(j)) for j in range(n)]
        assert component_minimum(n, a, b).tolist() == want


def test_chain_keeps_only_the_lowest_id(tmp_path, corpus):
    """a ~ b ~ c with a, c not similar: the components keep a alone; the in-memory index keeps a and c."""
    _, tok, _, _ = corpus
    a = prose(300, 7)
    b = edit(a, list(range(10, 150, 20)), 1)
    c = edit(b, list(range(160, 300, 20)), 2)
    mh = MinHasher(DedupConfig())
    sig = {k: mh.signature(t)[1] for k, t in (("a", a), ("b", b), ("c", c))}
    assert estimated_jaccard(sig["a"], sig["b"]) >= 0.7 and estimated_jaccard(sig["b"], sig["c"]) >= 0.7
    assert estimated_jaccard(sig["a"], sig["c"]) < 0.7
    f = tmp_path / "chain.jsonl"
    f.write_text("".join(json.dumps({"text": t}) + "\n" for t in (a, b, c)), encoding="utf-8")
    m = prepare([str(f)], str(tmp_path / "c"), tokenizer=tok, log=None, options={"dedup": "near"})
    assert m["documents"] == 1 and m["report"]["stages"]["dedup"]["removed"] == {"near_duplicate": 2}
    index = DedupIndex(DedupConfig())
    assert [index.check(exact_digest(t), *mh.signature(t)) for t in (a, b, c)] == [
        None,
        "near_duplicate",
        None,
    ]


def test_scheduled_tasks_and_killed_run_resume(corpus, reference, tmp_path, monkeypatch):
    root, tok, inputs, _ = corpus
    layout = {"partitions": 4, "buckets": 8}
    out = str(tmp_path / "s")

    def run(**kw):
        return prepare(inputs, out, tokenizer=tok, log=None, options=OPTS, stages={**layout, **kw})

    assert run(stage=1, task=0)["report"]["tasks"] == 1
    marker = tmp_path / ".s.work" / "staged" / "stats" / "1-00000.json"
    stamp = marker.stat().st_mtime_ns
    with pytest.raises(ConfigError, match=r"Stage 1 \(screen\) is not finished .* tasks 1, 2, 3 of 4"):
        run(stage=2)
    with pytest.raises(ConfigError, match="another plan"):
        prepare(inputs, out, tokenizer=tok, log=None, options=OPTS, stages={"partitions": 3, "stage": 1})
    with pytest.raises(ConfigError, match="stage 2 .* has 8 tasks"):
        run(stage=2, task=8)
    for stage in (1, 2, 3):
        assert run(stage=stage)["report"]["tasks"] == {1: 4, 2: 8, 3: 1}[stage]
    assert marker.stat().st_mtime_ns == stamp  # task 0 of stage 1 was not redone
    calls: list[tuple[int, int]] = []
    real = dict(tasks.RUNNERS)

    def counted(stage):
        def runner(ctx, k):
            calls.append((stage, k))
            if stage == 4 and len(calls) == 2:
                raise KeyboardInterrupt  # killed during the second tokenize task
            return real[stage](ctx, k)

        return runner

    monkeypatch.setattr(tasks, "RUNNERS", {s: counted(s) for s in real})
    with pytest.raises(KeyboardInterrupt):
        run()
    assert not Path(f"{out}.manifest.json").exists()
    m = run()
    assert calls == [(4, 0), (4, 1), (4, 1), (4, 2), (4, 3)]  # stages 1-3 and task 4.0 were not redone
    assert shard_hashes(m) == shard_hashes(reference)
    assert run() == m  # complete: a no-op


def test_bad_input_on_local_workers_and_skip_counts(corpus, tmp_path):
    import gzip

    root, tok, inputs, _ = corpus
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "good one"}\n{"text": "\xff"}\n{broken\n{"other": 1}\n{"text": "good two"}\n')
    with pytest.raises(DataError, match="bad.jsonl' line 2 is not valid UTF-8"):
        prepare([inputs[0], str(bad)], str(tmp_path / "o1"), tokenizer=tok, log=None, options=OPTS, workers=2)
    assert not (tmp_path / ".o1.work").exists() and not (tmp_path / "o1.manifest.json").exists()
    whole = gzip.compress("".join(json.dumps({"text": f"doc {i} " * 40}) + "\n" for i in range(300)).encode())
    trunc = tmp_path / "trunc.jsonl.gz"
    trunc.write_bytes(whole[: len(whole) // 2])
    two = [str(bad), str(trunc)]
    skip = {"on_error": "skip"}
    old = prepare(two, str(tmp_path / "old"), tokenizer=tok, log=None, options=skip)  # the one-process path
    new = prepare(two, str(tmp_path / "new"), tokenizer=tok, log=None, options=skip,
                  stages={"partitions": 5, "buckets": 2})  # fmt: skip  # both files sliced
    assert new["report"]["errors_skipped"] == old["report"]["errors_skipped"] == {
        "invalid_utf8": 1, "invalid_json": 1, "missing_key": 1, "truncated_file": 1}  # fmt: skip
    assert new["report"]["stages"] == old["report"]["stages"]
    assert shard_hashes(new) == shard_hashes(old) and old["documents"] > 2


def test_plan_partitions():
    class F:
        def __init__(self, size):
            self.size = size

        def stat(self):
            return self

        @property
        def st_size(self):
            return self.size

        def __str__(self):
            return f"f{self.size}"

    runs = make_plan([F(s) for s in (10, 10, 10, 10, 40, 1, 1)], 3, 2).partitions  # type: ignore[misc]
    assert [[u[0] for u in p] for p in runs] == [[0, 1, 2], [3, 4], [5, 6]]
    sliced = make_plan([F(30), F(10)], 5, 2)  # type: ignore[list-item]
    assert [p[0] for p in sliced.partitions] == [(0, 0, 4), (0, 1, 4), (0, 2, 4), (0, 3, 4), (1, 0, 1)]
    assert sliced.groups() == [[0, 1, 2, 3], [4]]


def test_capacity_plan_and_cli(corpus, reference, tmp_path, capfd):
    root, tok, inputs, rows = corpus
    est = estimate(inputs, options_from(dict(OPTS)), tok)
    assert round(est["documents"]) == len(rows) and est["files"] == 6
    text = format_plan(est, [1, 16], 12)
    assert "cores for 12 h: 1" in text and "16 cores" in text and "1 TB stored" in text
    assert est["disk_bytes"]["stage 1 bucket rows"] == pytest.approx(
        est["documents"] * est["kept_share"] * 21 * 24
    )
    argv = ["prepare", "--input", *inputs, "--output", str(tmp_path / "cli"), "--tokenizer", tok, "--clean",
            "--filter", "--dedup", "near", "--num-shards", "2", "--partitions", "2", "--buckets", "3"]  # fmt: skip
    assert cli(argv) == 0
    m = json.loads((tmp_path / "cli.manifest.json").read_text())
    assert shard_hashes(m) == shard_hashes(reference)
    capfd.readouterr()
    assert cli(["prepare", "--input", inputs[0], "--output", str(tmp_path / "x"), "--tokenizer", tok,
                "--task", "1"]) == 2  # fmt: skip
    assert "--task 1 needs --stage S" in capfd.readouterr().err
    assert cli(["prepare", "--plan", *inputs, "--dedup", "near", "--plan-cores", "1,8"]) == 0
    assert "wall time on N cores" in capfd.readouterr().out


ROW = re.compile(
    r"^    (\d) (\w+) +([\d,]+)  ([\d,]+) ([a-z ]+?) +([\d,]+) ([a-z]+) +([\d,]+) +(\S+) +(\S+) +(\S+)  (\S+)"
)


def staged_rows(text: str) -> tuple[str, dict[str, tuple]]:
    """(the section's first line, {stage: (tasks, in, in unit, out, out unit, bytes, wall, task s, CPU s, RSS)})
    of a report.txt's staged section, numbers as ints (wall / task / CPU / RSS as printed)."""
    section = text.split("\n  staged dedup: ", 1)[1]
    rows = {}
    for line in section.splitlines():
        if m := ROW.match(line):
            g = m.groups()
            num = [int(g[i].replace(",", "")) for i in (2, 3, 5, 7)]
            rows[g[1]] = (num[0], num[1], g[4], num[2], g[6], num[3], *g[8:])
    return section.splitlines()[0], rows


def test_report_txt_staged_section_against_manifest_and_planting(corpus, reference):
    """The one-process reference (1 partition x 1 bucket): every figure of the report's staged section equals
    the manifest's ``report.staged``, and the counts equal the planting: 93 rows, 3 too short, 21 key rows per
    kept document (20 bands + the digest), 24 pairs (each cluster a star on its lowest id: 20 pairs + 2 triples
    of 2), 22 clusters with a copy, 24 copies dropped (10 exact, 14 near), 66 kept; the write row's bytes are the
    shard files on disk."""
    root = corpus[0]
    text = (root / "one.report.txt").read_text(encoding="utf-8")
    head, rows = staged_rows(text)
    assert head.startswith("1 partition x 1 bucket, engine local, 1 worker (engine start ")
    staged = reference["report"]["staged"]["stages"]
    want = {"screen": (93, "documents", 90, "documents"), "pairs": (90 * 21, "key rows", 24, "pairs"),
            "components": (24, "pairs", 22, "components"), "tokenize": (90, "documents", 66, "documents")}  # fmt: skip
    keys = {"screen": ("docs_in", "docs_out"), "pairs": ("rows_in", "pairs"),
            "components": ("pairs_in", "components"), "tokenize": ("docs_in", "docs_out")}  # fmt: skip
    for name, (n_in, u_in, n_out, u_out) in want.items():
        s = staged[name]
        tasks, got_in, unit_in, got_out, unit_out, nbytes, wall, secs, cpu, rss = rows[name]
        assert (got_in, unit_in, got_out, unit_out) == (n_in, u_in, n_out, u_out), name
        assert (s[keys[name][0]], s[keys[name][1]]) == (n_in, n_out) and tasks == s["tasks"] == 1
        assert nbytes == s["bytes"] > 0 and rss == f"{s['peak_rss_mb_max']:,.1f}" and s["peak_rss_mb_max"] > 0
        assert (wall, secs, cpu) == (
            f"{s['wall_seconds']:.2f}",
            f"{s['seconds']:.2f}",
            f"{s['cpu_seconds']:.2f}",
        )
        assert s["resumed"] == 0
    c = staged["components"]
    assert (c["nodes"], c["dropped"], c["exact_duplicate"], c["near_duplicate"]) == (46, 24, 10, 14)
    assert "components: 46 documents in pairs, 24 dropped (exact 10, near 14)" in text
    assert (
        f"tokenize: {reference['tokens']:,} tokens" in text
        and staged["tokenize"]["tokens"] == reference["tokens"]
    )
    on_disk = sum((root / f"one_{i:05d}{x}").stat().st_size for i in range(2) for x in (".bin", ".idx"))
    assert rows["write"][:6] == (1, 66, "documents", 2, "shards", on_disk)


def test_ray_bad_input_exit_2_nothing_written_and_skip_counts(corpus, ray_local, tmp_path, capfd):
    """Through the CLI on 2 Ray workers: a broken line is exit code 2 naming file and line, no traceback, and
    nothing of the output (nor the work folder) is left; with --on-error skip the errors are counted in the
    manifest and report.txt, and the kept documents are byte-identical to 2 local workers'."""
    root, tok, inputs, rows = corpus
    bad = tmp_path / "bad.jsonl"
    good = [prose(150, 500), prose(160, 501)]
    bad.write_bytes(b"".join([json.dumps({"text": good[0]}).encode(), b'\n{"text": "\xff"}\n{broken\n{"other": 1}\n',
                              json.dumps({"text": good[1]}).encode(), b"\n"]))  # fmt: skip
    three = [*inputs[:2], str(bad)]

    def run(out: str, *extra: str) -> int:
        return cli(["prepare", "--input", *three, "--output", str(tmp_path / out), "--tokenizer", tok, "--clean",
                    "--filter", "--dedup", "near", "--num-shards", "2", "--workers", "2", *extra])  # fmt: skip

    capfd.readouterr()
    assert run("o", "--engine", "ray") == 2
    err = capfd.readouterr().err
    assert "bad.jsonl' line 2 is not valid UTF-8" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no o.bin/.idx/manifest/report/work
    assert run("r", "--engine", "ray", "--on-error", "skip") == 0
    assert run("l", "--engine", "local", "--on-error", "skip") == 0
    ray_m, local_m = (json.loads((tmp_path / f"{x}.manifest.json").read_text()) for x in ("r", "l"))
    skipped = {"invalid_utf8": 1, "invalid_json": 1, "missing_key": 1}
    assert ray_m["report"]["errors_skipped"] == local_m["report"]["errors_skipped"] == skipped
    assert (
        shard_hashes(ray_m) == shard_hashes(local_m)
        and ray_m["report"]["stages"] == local_m["report"]["stages"]
    )
    kept = expected([r for r in rows if r[0] < 2])[0]
    assert ray_m["documents"] == len(kept) + 2
    t = load_tokenizer(tok)
    shards = [read_megatron(str(tmp_path / s["name"])) for s in ray_m["shards"]]
    got = [shards[i % 2][i // 2] for i in range(sum(map(len, shards)))]
    assert got == [t.encode(clean_text(x)) + [t.eos_id] for x in kept + good]
    text = (tmp_path / "r.report.txt").read_text(encoding="utf-8")
    assert "input errors skipped (--on-error skip): invalid_json 1, invalid_utf8 1, missing_key 1" in text
    head, table = staged_rows(text)
    assert head.startswith("3 partitions x 3 buckets, engine ray, 2 workers")
    assert (
        table["screen"][1] == sum(r[0] < 2 for r in rows) + 2
    )  # documents read: the errors are not documents
