"""Put the trained bar of issue 44 into the records made before it: each run's ``bigram`` (the
count bigram's loss on the bytes the run's own loss scores, ``lm.bigram_loss``) and its
``trained`` flag recomputed as own loss < bigram, in results.csv; the manifest's setting
``stuck_fraction`` (the old bar, 95 % of the unigram entropy) becomes ``trained_bar: bigram``.
Then ``fastweights reproduce NAME --render`` judges with the new bar. Idempotent.

    python benchmarks/results/reproduce/bigram_bar.py [NAME ...]   # default: every LM record

The windows are rebuilt from the corpus and the record's settings exactly as the experiment
built them (``stdlib`` is the running Python's standard library: the same files as the records'
Python 3.11, 91 validation files).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastweights.reproduce import fwp_lm, lm
from fastweights.reproduce.common import MANIFEST, read_csv, write_csv

HERE = Path(__file__).resolve().parent


def own_metric(name: str, model: str) -> str:
    """The metric of a run that its trained flag reads (as the experiment's ``execute``)."""
    if name == "fwp-lm":
        return "loss_carried" if model in fwp_lm.CARRIED else "loss"
    return "loss_window" if name == "long-context" else "loss"


def starts_of(name: str, s: dict, corpus: lm.Corpus):
    """The validation windows (starts, length) the run's own loss scores."""
    T = s["seq_len"]
    if name == "long-context":
        return lm.stream_starts(corpus, T * s["factor"], s["streams"]), T
    context = s.get("context_windows", 0) * T if name == "fwp-lm" else 0
    return lm.eval_starts(corpus, T, s["eval_windows"], context), T


def migrate(name: str) -> str:
    folder = HERE / name
    manifest = json.loads((folder / MANIFEST).read_text())
    s = manifest["settings"]
    corpus = lm.corpus(s["data"])
    bar = lm.bigram_loss(corpus, corpus.val, *starts_of(name, s, corpus))
    rows = read_csv(folder / "results.csv")
    changed = []
    for r in rows:
        m = r["metrics"]
        own = m[own_metric(name, r["model"])]
        flag = float(own < bar)
        if m.get("trained") != flag:
            changed.append(f"{r['model']} seed {r['seed']}: {own:.4f} -> trained {flag:g}")
        m["trained"], m["bigram"] = flag, bar
    write_csv(folder / "results.csv", rows)
    s.pop("stuck_fraction", None)
    s["trained_bar"] = "bigram"
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return f"{name}: bigram {bar:.4f}; " + ("; ".join(changed) or "no flag changed")


if __name__ == "__main__":
    for name in sys.argv[1:] or ("fwp-lm", "long-context", "ttt-ablation", "transnormer", "aft"):
        print(migrate(name))
