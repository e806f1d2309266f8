"""The published layouts of issue 41 under the default engine (this trainer as it runs) beside the engine of the
stack that trained them: memory per device, fits, tokens/s, and the ratio of the two engines' tokens/s.

Each layout is the one tests/test_plan_published.py plans (same overrides, cluster and flags, through
``llmtrain plan``'s own parser); the default engine gets the same flags without ``--engine``. MindFormers'
DeepSeek-V3 671B file (tests/fixtures/mindformers/deepseek3_671b.yaml) is planned at its own 1024 cards
(dp 16 x mp 4 x 16 stages) without recompute (``--recompute none``, as issue 41 planned it), with the megatron
engine as the comparison. Run it on the
commit before a change and after it for the before/after table in docs/planner.md:

    .venv/bin/python bench/published_layouts.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from llmtrain.plan.search import evaluate  # noqa: E402
from test_plan_published import RUNS, user_layout  # noqa: E402

GA1 = ["train.micro_batch_size=4"]
"""Megatron-LM's README rows at one micro-batch per step (micro-batch 4 = batch 192 / dp 48), as issue 41 ran them."""
LAYOUTS = {  # row label -> (RUNS name, extra overrides)
    "Megatron-LM 7.1B ga1, 96 H100": ("megatron-7.1b", GA1),
    "Megatron-LM 32B ga1, 384 H100": ("megatron-32b", GA1),
    "DGXC Llama 3.1 8B, 8 H100": ("dgxc-llama3.1-8b", []),
    "DGXC Llama 3.1 70B, 64 H100": ("dgxc-llama3.1-70b", []),
    "DGXC Llama 3.1 405B, 576 H100": ("dgxc-llama3.1-405b", []),
    "DGXC Nemotron-4 340B, 128 H100": ("dgxc-nemotron4-340b", []),
    "torchtitan Llama 3 70B 2-D FP8, 256 H100": ("torchtitan-h100-70b-2d", []),
    "DGXC DeepSeek-V3, 1024 H100 (EP64)": ("dgxc-deepseek-v3-1024", []),
}
MINDFORMERS_DSV3 = "MindFormers DeepSeek-V3 671B file, 1024 cards"


def without_engine(flags: list[str]) -> list[str]:
    """The flags with ``--engine NAME`` removed: the default engine (llmtrain) for the same layout."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
        elif f == "--engine":
            skip = True
        else:
            out.append(f)
    return out


def planned(
    overrides: list[str], cluster: str, flags: list[str], base: str | None = None
) -> tuple[float, bool, float]:
    """(GiB per device, fits, tokens/s per device) of one layout."""
    if base is None:
        cfg, cl, lay, margs, tokens = user_layout(overrides, cluster, flags)
    else:  # a config file of its own (MindFormers' layout)
        import argparse

        from llmtrain.commands.plan import add_arguments, layout_options
        from llmtrain.config.loader import load_config
        from llmtrain.plan.catalog import load_catalog, parse_cluster
        from llmtrain.plan.search import layout_from_config

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        ns = parser.parse_args([base, *overrides, "--cluster", cluster, *flags])
        cfg, _ = load_config(ns.config, ns.overrides)
        cl = parse_cluster(ns.cluster, load_catalog())
        lay, margs, tokens = layout_from_config(
            cfg, cl.num_devices, ns.recompute or cfg.recompute.mode, ns.offload, **layout_options(ns)
        )
    r = evaluate(margs, lay, cl, tokens, bool(cfg.train.compile))
    return r.memory.total / 2**30, bool(r.memory.fits), r.tokens_per_s_per_device


def main() -> None:
    rows = []
    for label, (name, extra) in LAYOUTS.items():
        _, overrides, cluster, flags = RUNS[name]
        overrides = overrides + extra
        engine = flags[flags.index("--engine") + 1]
        rows.append(
            (
                label,
                engine,
                planned(overrides, cluster, without_engine(flags)),
                planned(overrides, cluster, flags),
            )
        )
    mf = str(ROOT / "tests" / "fixtures" / "mindformers" / "deepseek3_671b.yaml")
    none = ["--recompute", "none"]
    rows.append((MINDFORMERS_DSV3, "megatron", planned([], "1024xh100", none, mf),
                 planned([], "1024xh100", ["--engine", "megatron", *none], mf)))  # fmt: skip
    print("| layout | llmtrain GiB | fits | tokens/s | stack engine | its GiB | fits | tokens/s | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, engine, (g, f, t), (g2, f2, t2) in rows:
        yes = {True: "yes", False: "no"}
        print(
            f"| {label} | {g:.1f} | {yes[f]} | {t:,.0f} | {engine} | {g2:.1f} | {yes[f2]} | {t2:,.0f} | {t / t2:.2f}x |"
        )


if __name__ == "__main__":
    main()
