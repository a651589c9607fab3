"""Serving variants of granularity rowcol (format version 2: a float16 α per row and β per column):
the slots hold the column scales, a step mixing a rowcol variant, a row variant and the base decodes
each row as it would alone, the engine's greedy completion equals transformers ``generate`` on the
materialised checkpoint, and an engine started without such variants refuses one that appears later."""
from __future__ import annotations

import shutil

import pytest
import torch

from deltafleet.compress.bitdelta import compress, export_hf, load_artifact
from deltafleet.compress.distill import calibration_blocks, distill_scales
from deltafleet.serve.batch import DeltaSlots
from deltafleet.serve.engine import Engine, SamplingParams
from deltafleet.serve.runner import ModelRunner, StepInput
from tests.conftest import decode_alone, prefill_step


@pytest.fixture(scope="module")
def rowcol_family(tiny_family, tmp_path_factory):
    """artifacts/: ``coder`` distilled at granularity rowcol (its β moved off 1), ``writer`` as the
    family exported it (format version 1)."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("rowcol")
    base, ft = tiny_family.base_dir, tiny_family.variants["coder"]
    compress(base, ft, root / "src", variant="coder", granularity="rowcol")
    import json as json_module
    import inspect

    corpus = root / "train.jsonl"  # real Python source, the coder's kind of text
    text = inspect.getsource(json_module.encoder)
    corpus.write_text("".join(json_module.dumps({"text": text[i:i + 2000]}) + "\n" for i in range(0, 16000, 2000)))
    calib = calibration_blocks(corpus, AutoTokenizer.from_pretrained(base), 32, 8)
    arts = root / "artifacts"
    distill_scales(base, ft, root / "src", arts / "coder", calib, steps=6, lr=3e-3, beta_lr=0.1, loss="kl")
    shutil.copytree(tiny_family.artifacts_dir / "writer", arts / "writer")
    art = load_artifact(arts / "coder")
    assert art.manifest["format_version"] == 2 and any(not bool((b == 1).all()) for b in art.betas.values())
    return arts


@pytest.fixture(scope="module")
def engine(tiny_family, rowcol_family) -> Engine:
    return Engine(tiny_family.base_dir, rowcol_family, family="tiny")


def test_a_step_mixing_rowcol_row_and_base_decodes_each_row_as_if_alone(engine):
    model = engine.model
    assert engine.slots.betas, "an artifact of granularity rowcol at start: the slots hold column scales"
    slots = DeltaSlots(model, n_slots=2, col_scales=True)
    coder, writer = slots.put(engine.get_delta("tiny-coder")), slots.put(engine.get_delta("tiny-writer"))
    assert coder.betas and not writer.betas
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(slots.betas[name][writer.slot], torch.ones_like(slots.betas[name][writer.slot]))
    prompts = [engine.encode_prompt("import os\nimport"), engine.encode_prompt("The"), engine.encode_prompt("def f(")]
    deltas = [coder, writer, None]
    steps = 5
    with torch.inference_mode():
        want = [decode_alone(model, p, d, steps) for p, d in zip(prompts, deltas)]
        slot = [coder.slot, writer.slot, -1]
        runner = ModelRunner(model, slots, n_blocks=24, block_size=4, max_batch=4, max_seq_len=32)
        tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
        where = lambda b, t: tables[b][t // 4] * 4 + t % 4  # noqa: E731
        logits = runner.forward(prefill_step(prompts, slot, tables, where)).float()  # each prompt a run
        for i in range(steps):
            for b in range(3):
                torch.testing.assert_close(logits[b], want[b][i], rtol=1e-4, atol=1e-4, msg=lambda s: f"row {b} step {i}: {s}")
            nxt, pos = logits.argmax(-1).tolist(), [len(p) + i for p in prompts]
            step = StepInput(nxt, pos, [where(b, q) for b, q in enumerate(pos)], slot, 3, tables, [], [0, 1, 2])
            logits = runner.forward(step).float()
    # β matters: the same coder with its column scales set to 1 answers otherwise
    plain = engine.get_delta("tiny-coder")
    plain.betas = {k: torch.ones_like(v) for k, v in plain.betas.items()}
    with torch.inference_mode():
        assert not torch.allclose(decode_alone(model, prompts[0], plain, 1)[0], want[0][0], atol=1e-3)


def test_greedy_completion_equals_transformers_on_the_materialised_checkpoint(engine, tiny_family, rowcol_family,
                                                                               tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(export_hf(tiny_family.base_dir, rowcol_family / "coder", tmp_path / "hf"),
                                              dtype=torch.float32).eval()
    ids = engine.encode_prompt("import os\nimport")
    got = engine.complete("tiny-coder", ids, SamplingParams(temperature=0, max_tokens=10)).token_ids
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    assert got == out


def test_an_engine_started_without_rowcol_variants_refuses_one_added_later(tiny_family, rowcol_family, tmp_path):
    """Found by a fresh user: a rowcol artifact exported after the start was listed, then every request
    for it got a 503, which clients retry, though only a restart can serve it. It is now not served,
    like an artifact of another base: not listed, a 404 saying why and what to do, the warning logged
    once; so too a listed variant re-exported as rowcol, at its next request. The resident variants
    stay served, nothing evicted for it."""
    from deltafleet.serve.engine import InvalidRequestError, ModelNotFoundError

    arts = tmp_path / "artifacts"
    shutil.copytree(tiny_family.artifacts_dir / "writer", arts / "writer")
    shutil.copytree(tiny_family.artifacts_dir / "coder", arts / "plain")
    engine = Engine(tiny_family.base_dir, arts, family="tiny", delta_cache={"device_slots": 1})
    assert not engine.slots.betas
    params = SamplingParams(temperature=0, max_tokens=3)
    before = engine.complete("tiny-writer", "The", params).token_ids
    assert engine.slots.free_slots == 0
    shutil.copytree(rowcol_family / "coder", arts / "coder")
    assert "tiny-coder" not in [c.id for c in engine.discover()]
    refused = (r"The model `tiny-{}` is not served by this server: its artifact has column scales \(granularity "
               r"rowcol\), which this server's slots do not hold: it started without a rowcol variant; restart it")
    with pytest.raises(ModelNotFoundError, match=refused.format("coder")):
        engine.complete("tiny-coder", "import", params)
    shutil.rmtree(arts / "plain")  # listed, then re-exported as rowcol
    shutil.copytree(rowcol_family / "coder", arts / "plain")
    with pytest.raises(ModelNotFoundError, match=refused.format("plain")):
        engine.complete("tiny-plain", "import", params)
    assert "tiny-plain" not in [c.id for c in engine.models()]
    # a hot load of one is the caller's to fix, as docs/serving.md says: 400 artifact_unusable (it was a 404)
    with pytest.raises(InvalidRequestError, match=r"the artifact in `coder` cannot be used: it is not served by this "
                       r"server: its artifact has column scales") as refusal:
        engine.add_variant("again", "coder")
    assert (refusal.value.param, refusal.value.code) == ("path", "artifact_unusable")
    assert "tiny-again" not in [c.id for c in engine.models()]
    assert engine.cache.tier("tiny-writer") == "device"  # not evicted to make room for either
    assert engine.complete("tiny-writer", "The", params).token_ids == before
