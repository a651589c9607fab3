"""Print the family's held-out losses: base vs fine-tune vs BitDelta, per variant domain.

    python -m train.summary [models_dir]

Reads ``models/<name>/training.json`` written at the end of each ``train/run.py`` run. Fine-tunes
of different bases (the tiny family's ``models/coder``, the real base's ``models/smollm2-coder``)
get a table each, headed by their base.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def collect(models_dir: str | Path) -> list[dict]:
    """The ``training.json`` records of every fine-tune under ``models_dir`` (bases excluded), in
    folder order, each with ``model``: its folder's name."""
    rows = []
    for path in sorted(Path(models_dir).glob("*/training.json")):
        rec = json.loads(path.read_text())
        if rec.get("variant") != "base" and "heldout/base_loss" in rec:  # a base has no base loss
            rows.append({"model": path.parent.name, **rec})
    return rows


def by_base(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by the base they were fine-tuned from (``base_dir`` of the record; records of
    older runs, without it, under "")."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.get("base_dir", ""), []).append(r)
    return groups


def format_table(rows: list[dict]) -> str:
    """A Markdown table of held-out loss (nats/token) on each variant's own test split."""
    lines = ["| model | domain | base loss | fine-tune loss | BitDelta loss | gain recovered | bits/param |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        def f(key, fmt="{:.4f}"):
            return "—" if key not in r else "n/a" if r[key] is None else fmt.format(r[key])
        lines.append(f"| {r['model']} | {r['domain']} | {f('heldout/base_loss')} | {f('heldout/loss')} | "
                     f"{f('heldout/bitdelta_loss')} | {f('heldout/bitdelta_gain_recovered', '{:.2f}')} | "
                     f"{f('export/bits_per_parameter', '{:.3f}')} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: python -m train.summary [models_dir]", file=sys.stderr)
        return 2
    models_dir = Path(argv[0]) if argv else Path("models")
    rows = collect(models_dir)
    if not rows:
        print(f"no trained variants under {models_dir}/ (run `make family`)")
        return 1
    groups = by_base(rows)
    for i, (base, group) in enumerate(groups.items()):
        if len(groups) > 1:
            print(("\n" if i else "") + f"base: {base or 'not recorded (runs before base_dir was recorded)'}")
        print(format_table(group))
    worse = [r["model"] for r in rows if r["heldout/loss"] >= r["heldout/base_loss"]]
    if worse:
        print(f"WARNING: fine-tune no better than the base on its own domain: {', '.join(worse)}")
    served = [r["model"] for r in rows
              if r.get("heldout/bitdelta_loss", float("-inf")) >= r["heldout/base_loss"]]
    if served:
        print(f"WARNING: BitDelta artifact (what the server answers with) no better than the base on its own "
              f"domain: {', '.join(served)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
