"""Print the family's held-out losses: base vs fine-tune vs BitDelta, per variant domain.

    python -m train.summary [models_dir]

Reads ``models/<variant>/training.json`` written at the end of each ``train/run.py`` run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def collect(models_dir: str | Path) -> list[dict]:
    """The ``training.json`` records of every variant under ``models_dir`` (the base excluded), by name."""
    rows = []
    for path in sorted(Path(models_dir).glob("*/training.json")):
        rec = json.loads(path.read_text())
        if rec.get("variant") != "base":
            rows.append(rec)
    return rows


def format_table(rows: list[dict]) -> str:
    """A Markdown table of held-out loss (nats/token) on each variant's own test split."""
    lines = ["| variant | domain | base loss | fine-tune loss | BitDelta loss | gain recovered | bits/param |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        def f(key, fmt="{:.4f}"):
            return fmt.format(r[key]) if key in r else "—"
        lines.append(f"| {r['variant']} | {r['domain']} | {f('heldout/base_loss')} | {f('heldout/loss')} | "
                     f"{f('heldout/bitdelta_loss')} | {f('heldout/bitdelta_gain_recovered', '{:.2f}')} | "
                     f"{f('export/bits_per_parameter', '{:.3f}')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    models_dir = Path(argv[0]) if argv else Path("models")
    rows = collect(models_dir)
    if not rows:
        print(f"no trained variants under {models_dir}/ (run `make family`)")
        return 1
    print(format_table(rows))
    worse = [r["variant"] for r in rows if r["heldout/loss"] >= r["heldout/base_loss"]]
    if worse:
        print(f"WARNING: fine-tune no better than the base on its own domain: {', '.join(worse)}")
    served = [r["variant"] for r in rows
              if r.get("heldout/bitdelta_loss", float("-inf")) >= r["heldout/base_loss"]]
    if served:
        print(f"WARNING: BitDelta artifact (what the server answers with) no better than the base on its own "
              f"domain: {', '.join(served)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
