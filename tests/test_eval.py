"""`make eval` (train/eval.py): the math parser, the metrics, and the CLI end to end on a tiny family.

The metrics are checked against independent computations (``deltafleet.train.module.heldout_loss``,
``torch.nn.functional.kl_div`` in float64, the manifests' own statistics); the CLI runs on tiny
random Llama checkpoints with real text (Python's standard library, ``deltafleet.train.data``'s math
generator) in ``tmp_path``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from deltafleet.compress.bitdelta import load_artifact
from tests.conftest import build_tiny_family
from deltafleet.train.eval import (
    Problem,
    checkpoint_bits_per_parameter,
    gain_recovered,
    generate_answers,
    load_problems,
    parse_answer,
    split_problems,
    token_metrics,
)

REPO = Path(__file__).resolve().parents[1]
SETTINGS = ["base", "fine-tune", "bitdelta-matrix", "bitdelta-matrix+distill-mse", "bitdelta-matrix+distill-kl",
            "bitdelta-row", "bitdelta-row+distill-mse", "bitdelta-row+distill-kl",
            "bitdelta-rowcol", "bitdelta-rowcol+distill-mse", "bitdelta-rowcol+distill-kl"]
HEADER = ("| setting | bits/param | loss | ppl | task metric | KL(ft‖·) | gain recovered (loss) | "
          "gain recovered (task) |")


# --------------------------------------------------------------------------------------------
# Math problems
# --------------------------------------------------------------------------------------------

# One document of data/math/test.jsonl as `make data` wrote it (train.data.format_problem, "\n\n"-joined).
DOC = ("Question: What is 86 - 371?\nAnswer: -285\n\nQuestion: There are 11 boxes with 7 tickets in each box. "
       "Chloe takes away 6 tickets. How many tickets remain?\nAnswer: 71\n\nQuestion: What is the remainder when "
       "54985 is divided by 56?\nAnswer: 49")


def test_split_problems_on_a_real_document():
    assert split_problems(DOC) == [
        Problem("What is 86 - 371?", -285),
        Problem("There are 11 boxes with 7 tickets in each box. Chloe takes away 6 tickets. How many tickets remain?",
                71),
        Problem("What is the remainder when 54985 is divided by 56?", 49),
    ]
    assert split_problems(DOC)[0].prompt == "Question: What is 86 - 371?\nAnswer:"
    with pytest.raises(ValueError, match="Answer: <int>"):
        split_problems("Question: What is 2 + 2?\nAnswer: four")
    with pytest.raises(ValueError, match="Answer"):
        split_problems(DOC + "\n\nQuestion: What is 1 + 1?")  # a problem without its answer


def test_split_problems_round_trips_the_data_generator():
    from deltafleet.train.data import generate_math

    texts, _ = generate_math(60, seed=3)
    problems = split_problems("\n\n".join(texts))
    assert len(problems) == 60
    assert [f"{p.prompt} {p.answer}" for p in problems] == texts


@pytest.mark.parametrize("text, expected", [
    (" 120\n\nQuestion: What is", 120),        # what the demo math model generates (greedy, 10 tokens)
    (" 11910\n\nQuestion:", 11910),
    (" -285", -285),
    (" 1010", 1010),
    ("49 apples", 49),
    ("\n\nQuestion: What is", None),
    (" apples", None),
    (" - 3", None),
    ("", None),
])
def test_parse_answer_on_generated_text(text, expected):
    assert parse_answer(text) == expected


def test_load_problems_takes_the_first_n_in_file_order(tmp_path):
    from deltafleet.train.data import generate_math

    texts, _ = generate_math(10, seed=1)
    (tmp_path / "math").mkdir()
    (tmp_path / "math/test.jsonl").write_text(
        json.dumps({"text": "\n\n".join(texts[:4])}) + "\n\n" + json.dumps({"text": "\n\n".join(texts[4:])}) + "\n")
    assert [f"{p.prompt} {p.answer}" for p in load_problems(tmp_path, "math", "test", 6)] == texts[:6]
    assert len(load_problems(tmp_path, "math", "test", None)) == 10
    assert len(load_problems(tmp_path, "math", "test", 50)) == 10


# --------------------------------------------------------------------------------------------
# Gain recovered, bits per parameter
# --------------------------------------------------------------------------------------------


def test_gain_recovered():
    # loss (lower is better): base 5.0, fine-tune 4.0, compressed 4.2 keeps 80% of the gain
    assert gain_recovered(4.2, 5.0, 4.0) == pytest.approx(0.8)
    # accuracy (higher is better): the same ratio of differences
    assert gain_recovered(0.25, 0.10, 0.30) == pytest.approx(0.75)
    assert gain_recovered(5.0, 5.0, 4.0) == 0.0 and math.copysign(1, gain_recovered(5.0, 5.0, 4.0)) == 1
    assert gain_recovered(4.0, 5.0, 4.0) == 1.0
    assert gain_recovered(5.5, 5.0, 4.0) == pytest.approx(-0.5)  # worse than the base
    # the fine-tune equals the base: no gain to recover, undefined rather than a division by zero
    assert gain_recovered(0.02, 0.015, 0.015) is None
    assert gain_recovered(0.015, 0.015, 0.015) is None
    assert gain_recovered(float("nan"), 5.0, 4.0) is None
    assert gain_recovered(None, 5.0, 4.0) is None
    # found by a fresh user: a fine-tune worse than the base read as 1.77 of its "gain" recovered
    assert gain_recovered(6.0590, 6.0582, 6.0587, lower_is_better=True) is None
    assert gain_recovered(0.30, 0.20, 0.10, lower_is_better=False) is None
    assert gain_recovered(4.2, 5.0, 4.0, lower_is_better=True) == pytest.approx(0.8)
    assert gain_recovered(0.25, 0.10, 0.30, lower_is_better=False) == pytest.approx(0.75)


def test_checkpoint_bits_per_parameter(tmp_path):
    from tests.conftest import tiny_llama

    model = tiny_llama(64)
    model.save_pretrained(tmp_path / "fp32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert checkpoint_bits_per_parameter(tmp_path / "fp32") == 32.0
    assert checkpoint_bits_per_parameter(tmp_path / "bf16") == 16.0


# --------------------------------------------------------------------------------------------
# Token metrics and generation on a tiny family
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Tiny base + ``coder`` and ``math`` "fine-tunes", and data/{coder,math}/{train,test}.jsonl of real text."""
    from deltafleet.train.data import generate_math

    root = tmp_path_factory.mktemp("eval_family")
    fam = build_tiny_family(root, variants=("coder", "math"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = {"train": ["json/decoder.py", "json/encoder.py"], "test": ["glob.py", "bisect.py"]}
    texts, _ = generate_math(160, seed=0)
    for split, files in code.items():
        (root / "data/coder").mkdir(parents=True, exist_ok=True)
        (root / "data/coder" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"text": (stdlib / f).read_text()}) + "\n" for f in files))
        part = texts[:120] if split == "train" else texts[120:]
        (root / "data/math").mkdir(parents=True, exist_ok=True)
        (root / "data/math" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"text": "\n\n".join(part[i:i + 8])}) + "\n" for i in range(0, len(part), 8)))
    return fam


def _blocks(fam, domain="coder", split="test", seq_len=32):
    from transformers import AutoTokenizer

    from deltafleet.train.datamodule import load_blocks

    tok = AutoTokenizer.from_pretrained(fam.base_dir)
    return load_blocks(fam.root / "data", domain, split, tok, seq_len)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_token_metrics_match_heldout_loss_and_an_independent_kl(family):
    import torch.nn.functional as F

    from deltafleet.train.module import heldout_loss

    blocks = _blocks(family)[:10]
    base, ft = _load(family.base_dir), _load(family.variants["coder"])
    m = token_metrics({"base": base, "fine-tune": ft}, blocks, batch_size=4, reference=ft)
    assert m["fine-tune"]["loss"] == pytest.approx(heldout_loss(ft, blocks, batch_size=4), rel=1e-6)
    assert m["base"]["loss"] == pytest.approx(heldout_loss(base, blocks, batch_size=4), rel=1e-6)
    assert m["base"]["perplexity"] == pytest.approx(math.exp(m["base"]["loss"]))
    assert m["base"]["tokens"] == m["fine-tune"]["tokens"] == 10 * 31
    assert m["fine-tune"]["kl"] == 0.0  # the fine-tune against itself

    with torch.no_grad():  # one batch, float64, torch's own KL and argmax
        p = F.log_softmax(ft(input_ids=blocks).logits[:, :-1].double(), -1)
        q = F.log_softmax(base(input_ids=blocks).logits[:, :-1].double(), -1)
    kl = F.kl_div(q, p, log_target=True, reduction="sum").item() / (10 * 31)
    assert kl > 1e-3
    assert m["base"]["kl"] == pytest.approx(kl, rel=1e-4)
    acc = (q.argmax(-1) == blocks[:, 1:]).double().mean().item()
    assert m["base"]["next_token_accuracy"] == pytest.approx(acc, abs=1e-9)

    # a model against itself when it is not the same object: still 0 (up to float32 rounding)
    again = token_metrics({"copy": _load(family.variants["coder"])}, blocks, batch_size=3, reference=ft)["copy"]
    assert abs(again["kl"]) < 1e-6
    assert again["loss"] == pytest.approx(m["fine-tune"]["loss"], rel=1e-6)  # batch size does not matter


def test_batched_generation_equals_one_prompt_at_a_time(family):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(family.base_dir)
    problems = load_problems(family.root / "data", "math", "test", 7)
    assert len({len(tok(p.prompt)["input_ids"]) for p in problems}) > 1  # prompts of several lengths: padding
    model = _load(family.variants["math"])
    batched = generate_answers(model, tok, problems, batch_size=7, max_new_tokens=6)
    single = [generate_answers(model, tok, [p], batch_size=1, max_new_tokens=6)[0] for p in problems]
    assert batched == single
    for p, text in list(zip(problems, batched))[:3]:  # plain greedy decoding without a KV cache
        ids = [tok.eos_token_id, *tok(p.prompt, add_special_tokens=False)["input_ids"]]
        new = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
                if nxt == tok.eos_token_id:
                    break
                new.append(nxt)
        assert text == tok.decode(new, skip_special_tokens=True)


# --------------------------------------------------------------------------------------------
# The CLI end to end
# --------------------------------------------------------------------------------------------


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


def test_eval_cli_writes_the_report(family):
    from deltafleet.train.module import heldout_loss

    root = family.root
    untouched = {d: _tree_digest(root / d) for d in ("models", "artifacts")}
    run_dir = root / "outputs/eval/run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "train/eval.py", f"paths.root={root}", f"hydra.run.dir={run_dir}", "variants=[coder,math]",
         "seq_len=32", "batch_size=4", "max_test_blocks=6", "math.problems=5", "math.batch_size=3",
         "math.max_new_tokens=4", "distill.steps=2", "distill.batch_size=2", "distill.max_calibration_blocks=6",
         "goal.max_bits_per_parameter=1.5", "report.name=eval-test"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    stem = root / "reports/eval-test"
    payload = json.loads(stem.with_suffix(".json").read_text())
    assert [s["variant"] for s in payload["variants"]] == ["coder", "math"]
    assert payload["config"]["distill"]["steps"] == 2 and payload["config"]["seq_len"] == 32
    blocks = _blocks(family, seq_len=32)[:6]
    for s in payload["variants"]:
        v = s["variant"]
        rows = {r["setting"]: r for r in s["rows"]}
        assert [r["setting"] for r in s["rows"]] == SETTINGS + ["exported"]
        # the family's own artifact (artifacts/<variant>, matrix α), scored as it is: the same matrix
        # setting the eval builds afresh, so the same numbers
        exported = rows.pop("exported")
        assert exported["artifact"] == str(root / "artifacts" / v)
        manifest = json.loads((root / "artifacts" / v / "bitdelta.json").read_text())
        assert exported["bits_per_parameter"] == manifest["stats"]["bits_per_parameter"]
        assert exported["loss"] == rows["bitdelta-matrix"]["loss"] and exported["kl"] == rows["bitdelta-matrix"]["kl"]
        assert s["test_blocks"] == 6 and s["tokens"] == 6 * 31
        base, ft = rows["base"], rows["fine-tune"]
        assert (base["bits_per_parameter"], ft["bits_per_parameter"]) == (0.0, 32.0)
        assert ft["kl"] == 0.0 and base["kl"] > 0
        # (a fine-tune no better than the base on these few blocks has no gain to recover)
        gained = ft["loss"] < base["loss"]
        assert (ft["gain_recovered_loss"], base["gain_recovered_loss"]) == ((1.0, 0.0) if gained else (None, None))
        for name in SETTINGS[2:]:
            r = rows[name]
            art = run_dir / "artifacts" / f"{v}-{name.removeprefix('bitdelta-').replace('+', '-')}"
            assert r["artifact"] == str(art)
            manifest = json.loads((art / "bitdelta.json").read_text())
            assert r["bits_per_parameter"] == manifest["stats"]["bits_per_parameter"]
            g = name.removeprefix("bitdelta-").split("+")[0]
            assert manifest["granularity"] == g and manifest["format_version"] == (2 if g == "rowcol" else 1)
            assert 0 < r["kl"] < base["kl"] * 10
            expected = (r["loss"] - base["loss"]) / (ft["loss"] - base["loss"]) if gained else None
            assert r["gain_recovered_loss"] == pytest.approx(expected)
            assert (r["distillation"] is not None) == ("+distill-" in name)
        assert rows["bitdelta-row+distill-mse"]["distillation"]["steps"] == 2
        assert rows["bitdelta-row+distill-kl"]["distillation"]["loss"] == "kl"
        # rowcol: the export is the row solution with β = 1 (float16); distillation moves β too
        rc = load_artifact(run_dir / "artifacts" / f"{v}-rowcol")
        assert rc.betas.keys() == rc.signs.keys() and all(bool((b == 1).all()) for b in rc.betas.values())
        assert rows["bitdelta-rowcol"]["loss"] == pytest.approx(rows["bitdelta-row"]["loss"], abs=1e-3)
        rc_kl = load_artifact(run_dir / "artifacts" / f"{v}-rowcol-distill-kl")
        assert any(not bool((b == 1).all()) for b in rc_kl.betas.values())
        assert rows["bitdelta-rowcol+distill-kl"]["distillation"]["beta_lr"] == 1e-2
        # the best compressed setting within the bit budget (1.5 here: tiny models pay more for headers)
        within = [r for r in s["rows"][2:] if r["bits_per_parameter"] <= 1.5]
        assert within, "the matrix settings of this tiny family take about 1.4 bits/param"
        if gained:
            best = max(within, key=lambda r: r["gain_recovered_loss"])
            assert s["best"]["setting"] == best["setting"]
            assert f"{v}: best at ≤ 1.5 bits/param is {best['setting']} " in proc.stdout
        else:  # found by a fresh user: a fine-tune worse than the base read as 1.77 of its gain recovered
            assert s["best"] is None
            assert f"{v}: the fine-tune's loss is no lower than the base's on the test blocks" in proc.stdout
        if v == "coder":  # the fine-tune's loss is heldout_loss on the same blocks
            assert s["task_metric"] == "next-token accuracy" and s["problems"] == 0
            assert ft["loss"] == pytest.approx(heldout_loss(_load(family.variants["coder"]), blocks, 4), rel=1e-6)
            assert ft["task_metric"] == ft["next_token_accuracy"]
        else:
            assert s["task_metric"] == "exact match" and s["problems"] == 5
            assert all(r["task_metric"] * 5 == round(r["task_metric"] * 5) for r in s["rows"])

    md = stem.with_suffix(".md").read_text()
    assert md.count(HEADER) == 2
    for v in ("coder", "math"):
        section = md.split(f"## {v} ")[1].split("\n\n")[1].splitlines()
        assert section[0] == HEADER and [line.split(" | ")[0].lstrip("| ") for line in section[2:]] == SETTINGS + [
            "exported"]
    assert "exact-match accuracy on 5 problems" in md and "Machine: " in md and "seq_len 32" in md
    assert "## Best setting at ≤ 1.5 bits/param (goal: gain recovered ≥ 0.95)" in md
    assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # math: these random models answer 0 of 5, so the task's gain recovered is undefined, and says so
    math_rows = {r["setting"]: r for r in payload["variants"][1]["rows"]}
    assert math_rows["fine-tune"]["task_metric"] == math_rows["base"]["task_metric"] == 0.0
    assert all(r["gain_recovered_task"] is None for r in math_rows.values())
    assert md.split("## math ")[1].split("\n\n")[1].splitlines()[2].endswith("| n/a |")
    assert "n/a: the fine-tune does no better than the base" in md
    # the offline W&B run holds the rows as a table, and nothing was written into models/ or artifacts/
    (table,) = (root / "outputs/wandb").glob("offline-run-*/files/media/table/eval_*.table.json")
    table = json.loads(table.read_text())
    assert table["columns"][:3] == ["variant", "setting", "bits_per_parameter"]
    assert [row[:2] for row in table["data"]] == [[v, name] for v in ("coder", "math") for name in SETTINGS + ["exported"]]
    assert {d: _tree_digest(root / d) for d in ("models", "artifacts")} == untouched


def test_eval_scores_existing_artifacts_without_building(family, tmp_path):
    """``build=false``: only the base, the fine-tune and the artifacts named in ``existing`` (one per
    variant through ``{variant}``); a folder without an artifact is skipped and said so."""
    root = family.root
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "train/eval.py", f"paths.root={root}", f"hydra.run.dir={tmp_path / 'run'}", "variants=[coder]",
         "seq_len=32", "batch_size=4", "max_test_blocks=4", "build=false", "~logger", "report.name=eval-existing",
         f"report.dir={tmp_path}", "~existing", f"+existing={{shipped: '{root}/artifacts/{{variant}}', gone: '{tmp_path}/nowhere'}}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (section,) = json.loads((tmp_path / "eval-existing.json").read_text())["variants"]
    assert [r["setting"] for r in section["rows"]] == ["base", "fine-tune", "shipped"]
    assert section["rows"][2]["artifact"] == str(root / "artifacts" / "coder")
    assert f"[eval] coder: no artifact at {tmp_path}/nowhere: setting 'gone' skipped" in proc.stdout
    assert not (tmp_path / "run" / "artifacts").exists()  # nothing built
    header = (tmp_path / "eval-existing.md").read_text().split("\n## ")[0]
    assert "nothing built (build=false)" in header and "scale distillation" not in header
    proc = subprocess.run(
        [sys.executable, "train/eval.py", f"paths.root={root}", f"hydra.run.dir={tmp_path / 'run2'}", "variants=[coder]",
         "build=false", "~logger", f"report.dir={tmp_path}", "~existing", f"+existing={{gone: '{tmp_path}/nowhere'}}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "coder: no artifact in any folder of existing" in proc.stderr


def test_eval_settings_are_checked_before_any_work():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from deltafleet.train.eval import check_settings

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        default = compose(config_name="eval", overrides=["~logger"])

    def cfg(**over):
        c = OmegaConf.to_container(default)
        for key, v in over.items():
            where, *path = key.split("__")
            node = c
            for p in [where, *path][:-1]:
                node = node[p]
            node[[where, *path][-1]] = v
        return OmegaConf.create(c)

    with pytest.raises(ValueError, match=r"setting names \['bitdelta-row', 'fine-tune'\] are reserved"):
        check_settings(cfg(existing={"fine-tune": "a", "bitdelta-row": "b", "ok": "c"}))
    with pytest.raises(ValueError, match="build=false and no existing artifacts"):
        check_settings(cfg(build=False, existing={}))
    with pytest.raises(ValueError, match=r"the folders of \['bad', 'empty'\] must be paths"):
        check_settings(cfg(existing={"bad": 5, "empty": "", "ok": "x"}))
    check_settings(cfg(build=False, existing={"exported": "x/{variant}"}))
    # found by a fresh user: build=no built everything; a zero or negative count failed after the
    # builds, or was taken; variants=coder was read letter by letter, and a variant twice scored twice
    for over, message in [
            ({"build": "no"}, "build must be true or false, got 'no'"),
            ({"distill__enabled": "no"}, "distill.enabled must be true or false, got 'no'"),
            ({"max_test_blocks": 0}, "max_test_blocks must be a positive integer or null, got 0"),
            ({"max_test_blocks": -1}, "max_test_blocks must be a positive integer or null, got -1"),
            ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
            ({"seq_len": 0}, "seq_len must be a positive integer, got 0"),
            ({"math__problems": -3}, "math.problems must be a positive integer or null, got -3"),
            ({"goal__gain_recovered": float("nan")}, "goal.gain_recovered must be a finite number, got nan"),
            ({"variants": "coder"}, "variants must be a list, e.g. 'variants=[coder,math]', got 'coder'"),
            ({"variants": ["coder", "coder"]}, "variants lists ['coder'] more than once")]:
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            check_settings(cfg(**over))


def test_a_variant_no_config_trains_is_named_not_sent_to_train(tmp_path):
    """A missing fine-tune of a name ``conf/variant/`` lacks: the known names, not a command that
    would fail; a missing one of a known name keeps its build command."""
    from omegaconf import OmegaConf

    from deltafleet.train.eval import run, trainable_variants

    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        default = OmegaConf.to_container(compose(config_name="eval", overrides=["~logger", f"paths.root={tmp_path}"]),
                                         resolve=True)
    default.pop("existing")
    cfg = OmegaConf.merge(default, {"seed": 0, "build": True, "existing": {}, "variants": ["math", "nosuch"],
                                    "base_dir": str(tmp_path / "base"), "paths": {"models_dir": str(tmp_path)},
                                    "model": {"dirs": {"prefix": "tiny-"}}})
    assert {"coder", "math"} <= set(trainable_variants()) and "base" not in trainable_variants()
    with pytest.raises(FileNotFoundError, match=rf"^no fine-tune of math, nosuch under {tmp_path}, and nosuch is "
                                                r"not a variant train/run.py trains \(conf/variant/: chat, coder, "):
        run(cfg)
    cfg.variants = ["math"]
    with pytest.raises(FileNotFoundError, match=r"build it with `make train VARIANT=math`, or pick variants"):
        run(cfg)


def test_the_chart_has_every_variants_settings(monkeypatch):
    """Found by a reviewer: the chart took its settings, and their bits/param, from the first variant
    only, so an existing artifact that variant lacks (``exported`` of a fine-tune trained with the
    export off) had no bar for any variant, and an ``exported`` artifact of another granularity was
    labelled with the first variant's bits/param."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.axes import Axes

    from deltafleet.train.eval import plot_png

    def row(setting, bits, gain):
        return {"setting": setting, "bits_per_parameter": bits, "gain_recovered_loss": gain,
                "gain_recovered_task": gain}

    sections = [
        {"variant": "coder", "task_metric": "next-token accuracy",
         "rows": [row("base", 0.0, 0.0), row("fine-tune", 32.0, 1.0), row("bitdelta-matrix", 1.08, 0.7),
                  row("kl", 1.14, 0.95)]},
        {"variant": "math", "task_metric": "exact match",
         "rows": [row("base", 0.0, 0.0), row("fine-tune", 32.0, 1.0), row("bitdelta-matrix", 1.08, 0.8),
                  row("exported", 1.14, 0.9), row("kl", 1.08, 0.97)]},
    ]
    bars = []
    real_bar = Axes.bar

    def bar(self, x, height, *args, **kwargs):
        bars.append((kwargs.get("label"), [None if math.isnan(h) else h for h in height]))
        return real_bar(self, x, height, *args, **kwargs)

    monkeypatch.setattr(Axes, "bar", bar)
    png = plot_png({"variants": sections, "config": {"goal": {"gain_recovered": 0.95}}})
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    expected = [("bitdelta-matrix (1.08 bits/param)", [0.7, 0.8]), ("kl (1.08–1.14 bits/param)", [0.95, 0.97]),
                ("exported (1.14 bits/param)", [None, 0.9])]
    assert bars == expected + expected  # the loss panel, then the task panel


def test_a_report_that_cannot_be_drawn_writes_none_of_its_files(tmp_path, monkeypatch):
    """Found by a reviewer: ``write_report`` wrote the JSON and the Markdown before it drew the chart,
    so a chart that failed (matplotlib missing or broken) left two of the report's three files."""
    from deltafleet.train import eval as E

    def broken(payload):
        raise RuntimeError("no chart")

    monkeypatch.setattr(E, "report_markdown", lambda payload: "# report\n")
    monkeypatch.setattr(E, "plot_png", broken)
    with pytest.raises(RuntimeError, match="no chart"):
        E.write_report({"variants": []}, tmp_path / "eval-x")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(E, "plot_png", lambda payload: b"\x89PNG")
    assert E.write_report({"variants": []}, tmp_path / "eval-x") == "# report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval-x.json", "eval-x.md", "eval-x.png"]
    assert json.loads((tmp_path / "eval-x.json").read_text()) == {"variants": []}


def test_the_json_report_is_strict_json(tmp_path, monkeypatch):
    """Found by a reviewer: a NaN KL or an infinite perplexity went into the report as ``NaN`` /
    ``Infinity``, which strict JSON readers refuse; they are null, as in the summary."""
    from deltafleet.train import eval as E

    monkeypatch.setattr(E, "report_markdown", lambda payload: "# report\n")
    monkeypatch.setattr(E, "plot_png", lambda payload: b"\x89PNG")
    payload = {"variants": [{"rows": [{"perplexity": float("inf"), "kl": float("nan"), "loss": 2.5,
                                       "bits": (1.08, float("-inf"))}]}]}
    E.write_report(payload, tmp_path / "eval-x")

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    got = json.loads((tmp_path / "eval-x.json").read_text(), parse_constant=refuse)
    assert got == {"variants": [{"rows": [{"perplexity": None, "kl": None, "loss": 2.5, "bits": [1.08, None]}]}]}


def test_a_loss_too_large_to_exponentiate_has_an_infinite_perplexity():
    """Found by a reviewer: ``token_metrics`` took ``math.exp`` of every loss, so one setting scoring
    above ~709.8 nats/token (a broken artifact's huge logits) ended the whole report in an
    OverflowError after every setting had been built; its perplexity is now inf."""
    import types

    class Scaled(torch.nn.Module):  # the same random logits for every call, times `scale`
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, input_ids):
            g = torch.Generator().manual_seed(0)
            return types.SimpleNamespace(logits=torch.randn(*input_ids.shape, 50, generator=g) * self.scale)

    blocks = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    ref = Scaled(1.0)
    m = token_metrics({"fine-tune": ref, "broken": Scaled(1e4)}, blocks, 2, reference=ref)
    assert m["broken"]["loss"] > 1000 and m["broken"]["perplexity"] == math.inf
    assert m["fine-tune"]["perplexity"] == pytest.approx(math.exp(m["fine-tune"]["loss"]))
    assert m["broken"]["kl"] > 1000 and m["fine-tune"]["kl"] == 0.0
