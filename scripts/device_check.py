#!/usr/bin/env python
"""Figures for ``scripts/device_check.sh``.

    python scripts/device_check.py plot-bench BENCH_JSON OUT_PNG   # eval_acceptance.py --json rows
    python scripts/device_check.py plot-train METRICS_JSONL OUT_PNG  # train_mtp.py metrics.jsonl
"""
from __future__ import annotations

import argparse
import json


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_bench(src: str, dst: str) -> None:
    """Grouped bars: plain and speculative tok/s per batch size (one bar per K)."""
    with open(src) as f:
        rows = json.load(f)["rows"]
    if not rows:
        raise SystemExit(f"{src}: no rows")
    plt = _plt()
    batches = sorted({r["batch"] for r in rows})
    ks = sorted({r["k"] for r in rows})
    width = 0.8 / (len(ks) + 1)
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(batches), 4))
    for i, b in enumerate(batches):
        plain = next(r["plain_tok_s"] for r in rows if r["batch"] == b)
        bars = [("plain", plain)] + [(f"K={k}", r["spec_tok_s"]) for k in ks for r in rows
                                     if r["batch"] == b and r["k"] == k]
        for j, (name, v) in enumerate(bars):
            x = i + (j - len(ks) / 2) * width
            ax.bar(x, v, width, color=f"C{j}", label=name if i == 0 else None)
            ax.text(x, v, f"{v:.1f}" if v < 100 else f"{v:.0f}", ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("generated tokens / s")
    ax.set_title("plain vs MTP speculative decoding (greedy)", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def plot_train(src: str, dst: str) -> None:
    """Training loss and held-out first-draft acceptance against the step."""
    with open(src) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    if not recs:
        raise SystemExit(f"{src}: no metrics")
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=1, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    key = "eval_acc1"          # held-out first-draft greedy acceptance (jmtp.train.objective)
    ev = [r for r in recs if key in r]
    if ev:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in ev], [r[key] for r in ev], "o-", color="C1",
                 label="held-out first-draft acceptance")
        ax2.set_ylabel("acceptance")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    ax.set_title("MTP-head self-distillation")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("plot-bench", "plot-train"))
    ap.add_argument("src")
    ap.add_argument("dst")
    a = ap.parse_args(argv)
    (plot_bench if a.what == "plot-bench" else plot_train)(a.src, a.dst)
    print(f"wrote {a.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
