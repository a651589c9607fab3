"""Print the family's held-out losses: base vs fine-tune vs BitDelta, per variant domain.

    python -m deltafleet.train.summary [models_dir]      # deltafleet summary [models_dir]

Reads ``models/<name>/training.json`` written at the end of each ``train/run.py`` run. Fine-tunes
of different bases (the tiny family's ``models/coder``, the real base's ``models/smollm2-coder``)
get a table each, headed by their base. The BitDelta columns are the artifact the run exported
(``export/out_dir``): one exported again since (``compress/run.py``, another run id in its manifest's
provenance) shows its own bits per parameter and no loss (``make eval`` scores it); one removed, none.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def collect(models_dir: str | Path) -> list[dict]:
    """The ``training.json`` records of every fine-tune under ``models_dir`` (bases excluded: models
    trained from scratch, which record ``heldout/initial_loss``), in folder order, each with
    ``model``: its folder's name. A record that cannot be read, or a fine-tune's without its
    held-out losses, is left out with a line on stderr naming it."""
    rows = []
    for path in sorted(Path(models_dir).glob("*/training.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"skipped {path}: not a readable JSON record ({e})", file=sys.stderr)
            continue
        # a base has no base loss: "base", or a model trained from scratch under another name
        if not isinstance(rec, dict) or rec.get("variant") == "base" or "heldout/initial_loss" in rec:
            continue
        missing = [k for k in ("heldout/base_loss", "heldout/loss") if not isinstance(rec.get(k), (int, float))]
        if missing:
            print(f"skipped {path}: it records no {', '.join(missing)} (a run stopped before its evaluation?)",
                  file=sys.stderr)
            continue
        rows.append({"model": path.parent.name, **rec, **_artifact_now(rec)})
    return rows


def _artifact_now(rec: dict) -> dict:
    """``artifact``: whether the artifact the run exported is still the one on disk (``"run"``), was
    exported again since (``"re-exported"``, with its ``export/bits_per_parameter``) or is gone
    (``"gone"``); nothing for records of runs that did not record where they exported."""
    out = rec.get("export/out_dir")
    if out is None:
        return {}
    if not (Path(out) / "bitdelta.json").is_file():  # only a regular file is read: a named pipe would block
        return {"artifact": "gone"}
    try:
        manifest = json.loads((Path(out) / "bitdelta.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {"artifact": "gone"}
    if not isinstance(manifest, dict):
        return {"artifact": "gone"}
    if manifest.get("provenance", {}).get("run_id") == rec.get("run_id"):
        return {"artifact": "run"}
    return {"artifact": "re-exported", "export/bits_per_parameter": manifest.get("stats", {}).get("bits_per_parameter")}


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
    notes = []
    for r in rows:
        state = r.get("artifact", "run")

        def f(key, fmt="{:.4f}"):
            if key.startswith("heldout/bitdelta") and state != "run":
                return "—"
            if key.startswith("export/") and state == "gone":
                return "gone"
            return "—" if key not in r else "n/a" if r[key] is None else fmt.format(r[key])
        mark = "*" if state == "re-exported" else ""
        lines.append(f"| {r['model']} | {r['domain']} | {f('heldout/base_loss')} | {f('heldout/loss')} | "
                     f"{f('heldout/bitdelta_loss')} | {f('heldout/bitdelta_gain_recovered', '{:.2f}')} | "
                     f"{f('export/bits_per_parameter', '{:.3f}')}{mark} |")
        if state != "run":
            notes.append(f"{r['model']}: its artifact ({r['export/out_dir']}) " + (
                "was exported again after training: * its own bits/param; `make eval` scores its loss"
                if state == "re-exported" else "is gone: nothing of it is served"))
    return "\n".join(lines + notes)


USAGE = "usage: python -m deltafleet.train.summary [models_dir]   (deltafleet summary [models_dir])"


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print(USAGE, file=sys.stderr)
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
    served = [r["model"] for r in rows if r.get("artifact", "run") == "run"
              and r.get("heldout/bitdelta_loss", float("-inf")) >= r["heldout/base_loss"]]
    if served:
        print(f"WARNING: BitDelta artifact (what the server answers with) no better than the base on its own "
              f"domain: {', '.join(served)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
