"""Rows of different variants in one step (serve/batch.py): the stacked variant slots, and a batch of
base + two variants — prefilled together (each prompt a run of the one-variant kernel), then decoded
together at different positions (the mixed-variant kernel) — against each sequence run alone."""
from __future__ import annotations

import pytest
import torch

from deltafleet.kernels import tile_signs, untile_signs
from deltafleet.serve.batch import DeltaSlots
from deltafleet.serve.engine import Engine
from deltafleet.serve.model import DeltaLinear
from deltafleet.serve.runner import ModelRunner, StepInput
from tests.conftest import decode_alone, prefill_step


@pytest.fixture(scope="module")
def engine(tiny_family) -> Engine:
    return Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny")


@pytest.mark.parametrize("layout", ["rows", "tiled"])
def test_a_mixed_batch_decodes_each_row_as_if_alone(engine, layout):
    model = engine.model
    slots = DeltaSlots(model, n_slots=2, sign_layout=layout)
    coder = slots.put(engine.get_delta("tiny-coder"))
    writer = slots.put(engine.get_delta("tiny-writer"))
    assert {coder.slot, writer.slot} == {0, 1} and slots.free_slots == 0
    prompts = {"tiny": engine.encode_prompt("def main("), "tiny-coder": engine.encode_prompt("import os\nimport"),
               "tiny-writer": engine.encode_prompt("The")}
    deltas = {"tiny": None, "tiny-coder": coder, "tiny-writer": writer}
    steps = 6
    with torch.inference_mode():
        want = {m: decode_alone(model, p, deltas[m], steps) for m, p in prompts.items()}
        # one prefill step of the three prompts, then decode steps of the three rows, over a paged cache
        order = ["tiny-writer", "tiny", "tiny-coder"]
        slot = [-1 if deltas[m] is None else deltas[m].slot for m in order]
        runner = ModelRunner(model, slots, n_blocks=24, block_size=4, max_batch=4, max_seq_len=32)
        tables = [list(range(8 * i + 7, 8 * i - 1, -1)) for i in range(3)]  # blocks in no particular order
        where = lambda b, t: tables[b][t // 4] * 4 + t % 4  # noqa: E731
        logits = runner.forward(prefill_step([prompts[m] for m in order], slot, tables, where)).float()
        for b, m in enumerate(order):
            torch.testing.assert_close(logits[b], want[m][0], rtol=1e-5, atol=1e-5)
        nxt, pos = logits.argmax(-1).tolist(), [len(prompts[m]) for m in order]
        for i in range(1, steps):
            step = StepInput(nxt, pos, [where(b, q) for b, q in enumerate(pos)], slot, 3, tables, [], [0, 1, 2])
            logits = runner.forward(step).float()
            for b, m in enumerate(order):
                torch.testing.assert_close(logits[b], want[m][i], rtol=1e-4, atol=1e-4, msg=lambda s: f"{m} step {i}: {s}")
            nxt = logits.argmax(-1).tolist()
            pos = [q + 1 for q in pos]
    # the variants really differ from the base (the test would not notice a row using the wrong one)
    assert not torch.allclose(want["tiny-coder"][0], decode_alone(model, prompts["tiny-coder"], None, 1)[0], atol=1e-3)


@pytest.mark.parametrize("layout", ["rows", "tiled"])
def test_slots_views_are_the_variant_and_slots_are_reused(engine, layout):
    model = engine.model
    slots = DeltaSlots(model, n_slots=1, sign_layout=layout)
    coder = engine.get_delta("tiny-coder")
    view = slots.put(coder)
    ids = torch.tensor([engine.encode_prompt("hello world")])
    with torch.inference_mode():
        a = model(ids, torch.arange(ids.shape[1]), None, coder)
        b = model(ids, torch.arange(ids.shape[1]), None, view)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="all 1 variant slots are taken"):
        slots.put(engine.get_delta("tiny-writer"))
    slots.free(view)
    with pytest.raises(ValueError, match="not a taken slot"):
        slots.free(view)
    writer = slots.put(engine.get_delta("tiny-writer"))
    assert writer.slot == 0 and slots.free_slots == 0
    # writer changes norms; the slot's other norms are the base's again, not coder's leftovers
    for name, t in slots.full.items():
        want = engine.get_delta("tiny-writer").full.get(name, t[slots.n_slots])
        torch.testing.assert_close(t[0], want, rtol=0, atol=0)
    assert slots.slot_bytes == DeltaSlots.bytes_per_slot(model, layout) > 0
    # the linears' signs in the slot's layout (tiled: whole 64 × 16-byte tiles), the embedding's as rows
    held = sum(t[0].numel() for t in slots.signs.values()) + sum(t[0].numel() * 4 for t in slots.alphas.values()) \
        + sum(t[0].numel() * t.element_size() for t in slots.full.values())
    assert held == slots.slot_bytes
    q = slots.signs["model.layers.0.self_attn.q_proj.weight"]
    assert q.dim() == (5 if layout == "tiled" else 3)
    assert slots.signs["model.embed_tokens.weight"].dim() == 3


def test_slots_refuse_a_variant_with_a_full_matrix(engine):
    slots = DeltaSlots(engine.model, n_slots=1)
    coder = engine.get_delta("tiny-coder")
    fake = object.__new__(type(coder))
    fake.name, fake.signs, fake.alphas = "resized", {}, {}
    fake.full = {"model.embed_tokens.weight": torch.zeros(3, 4)}
    with pytest.raises(ValueError, match="'resized' stores 'model.embed_tokens.weight' in full"):
        slots.put(fake)
    with pytest.raises(ValueError, match="n_slots must be ≥ 1, got 0"):
        DeltaSlots(engine.model, 0)
    with pytest.raises(ValueError, match=r"^sign_layout must be one of \('rows', 'tiled'\), got 'cols'$"):
        DeltaSlots(engine.model, 1, sign_layout="cols")
    with pytest.raises(ValueError, match=r"^sign_layout must be one of \('rows', 'tiled'\), got 'cols'$"):
        DeltaSlots.bytes_per_slot(engine.model, "cols")  # not sized as rows
    with pytest.raises(ValueError, match=r"^delta_cache.sign_layout must be one of \('rows', 'tiled'\), got 'Tiled'$"):
        Engine(engine.base_dir, engine.artifacts_dir, family="tiny",
               delta_cache={"sign_layout": "Tiled", "device_budget_bytes": 1})  # named before the budget
    # a copy that fails (signs of the wrong shape, in rows and tiled) gives the slot back; tiled
    # signs (the engine's default slots hand them out) go into a row-layout table as rows
    name = "model.layers.0.self_attn.q_proj.weight"
    shape = {m.name + ".weight": m.weight.shape for m in engine.model.modules() if isinstance(m, DeltaLinear)}[name]
    rows = untile_signs(coder.signs[name], *shape)
    n, kb = rows.shape
    broken = object.__new__(type(coder))
    broken.name, broken.full = "broken", {}
    for bad, layout in ((torch.zeros(n + 1, kb, dtype=torch.uint8), "tiled"),
                        (torch.zeros(n, kb + 1, dtype=torch.uint8), "rows"),
                        (tile_signs(torch.zeros(n + 64, kb, dtype=torch.uint8)), "rows")):
        table = DeltaSlots(engine.model, n_slots=1, sign_layout=layout)
        broken.signs, broken.alphas = {name: bad}, {name: coder.alphas[name]}
        with pytest.raises(ValueError, match=f"^variant 'broken': signs of '{name}' have shape"):
            table.put(broken)
        assert table.free_slots == 1
    table = DeltaSlots(engine.model, n_slots=1, sign_layout="rows")
    view = table.put(coder)
    assert torch.equal(view.signs[name], rows)
    table.free(view)
    # rows one short or one long still pad into the same tiles: refused in both layouts, as is a
    # float tensor (which a copy would have cast)
    for bad in (rows[:-1], torch.cat([rows, rows[:1]]), rows[:, :-1], rows.float()):
        for layout in ("rows", "tiled"):
            table = DeltaSlots(engine.model, n_slots=1, sign_layout=layout)
            broken.signs = {name: bad}
            want = ("are torch.float32, not packed uint8" if bad.dtype != torch.uint8 else
                    rf"have shape \({bad.shape[0]}, {bad.shape[1]}\); the matrix takes rows \({n}, {kb}\)")
            with pytest.raises(ValueError, match=f"^variant 'broken': signs of '{name}' {want}"):
                table.put(broken)
            assert table.free_slots == 1


def test_an_engine_with_tiled_slots_answers_as_with_rows(engine, tiny_family):
    """``delta_cache.sign_layout: tiled`` (the default): the engine's slots hold the linears' signs
    tiled, and greedy completions of the base and both variants are a row-layout engine's, token for
    token."""
    from deltafleet.serve.engine import SamplingParams

    tiled = engine
    rows = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", delta_cache={"sign_layout": "rows"})
    assert tiled.slots.sign_layout == "tiled" and tiled.slots.tiled
    assert rows.slots.sign_layout == "rows" and not rows.slots.tiled
    params = SamplingParams(temperature=0, max_tokens=8)
    got = {}
    for model_id in ("tiny", "tiny-coder", "tiny-writer"):
        a = rows.complete(model_id, "def main(", params)
        got[model_id] = tiled.complete(model_id, "def main(", params).token_ids
        assert a.token_ids == got[model_id], model_id
    # the variants' deltas matter here (a layout read as zeros would answer like the base)
    assert got["tiny-coder"] != got["tiny"] and got["tiny-writer"] != got["tiny"]


def test_grouped_decode_rows_match_the_per_row_path(engine, monkeypatch):
    """The GPU path for large decode batches (``BatchDeltas.grouped``: rows grouped by variant once
    per step, the grouping reused by every layer; q, k, v and gate, up each one base GEMM over their
    stacked weights) run here under Triton's interpreter, against the per-row reference path on the
    same step: same logits, and one grouping for the whole forward."""
    pytest.importorskip("triton")
    from deltafleet.serve import batch
    from tests.conftest import record_groupings

    model = engine.model
    slots = DeltaSlots(model, n_slots=2, sign_layout="tiled")
    coder = slots.put(engine.get_delta("tiny-coder"))
    writer = slots.put(engine.get_delta("tiny-writer"))
    variants = [writer.slot, -1, coder.slot, coder.slot, -1, writer.slot, coder.slot]
    n = len(variants)
    tables = [[i] for i in range(n)]
    step = StepInput(tokens=[5 + i for i in range(n)], positions=[0] * n, kv_slots=[4 * i for i in range(n)],
                     variants=variants, n_decode=n, tables=tables, sample=list(range(n)))
    with torch.inference_mode():
        want = ModelRunner(model, slots, n_blocks=n, block_size=4, max_batch=8, max_seq_len=16).forward(step).float()
        groupings = record_groupings(monkeypatch)
        stacked, real = [], batch.bitdelta_linears_grouped
        monkeypatch.setattr(batch, "bitdelta_linears_grouped",
                            lambda x, w, sizes, *a, **k: stacked.append(len(sizes)) or real(x, w, sizes, *a, **k))
        got = ModelRunner(model, slots, n_blocks=n, block_size=4, max_batch=8, max_seq_len=16).forward(step).float()
    assert groupings == [variants]  # once per step, whatever the number of layers and linears
    assert stacked == [3, 2] * len(model.layers)  # q, k, v and gate, up of every layer
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the variants matter here: all rows on the base would answer differently
    base = StepInput(**{**step.__dict__, "variants": [-1] * n})
    with torch.inference_mode():
        alone = ModelRunner(model, slots, n_blocks=n, block_size=4, max_batch=8, max_seq_len=16).forward(base).float()
    assert not torch.allclose(alone, want, atol=1e-3)
