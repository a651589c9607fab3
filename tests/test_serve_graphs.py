"""Decode steps replayed as CUDA graphs (serve/graphs.py) against the eager step, on a GPU.

``gpu`` tests (``make test-gpu``): a tiny random Llama family (the tests' BPE tokenizer; a base of
width 256, 4 layers, 8 heads / 4 kv heads, so that the Triton mixed-tenant kernels run on their
real paths; three BitDelta variants, ``writer`` also changing norms) loaded on CUDA in bfloat16.
The padding and bucketing that the graphs rely on are tested without a GPU in
tests/test_serve_scheduler.py.

Tolerance: the graph replays the eager step's kernels on the same inputs, but on a batch padded to
its bucket, so a kernel may run another tile (the tuning key holds the row count) and sum its split-K
partials in another order. The two paths then differ by bf16 roundings through 4 layers: we allow
``max |graph − eager| ≤ 0.02 · max(1, max |eager|)`` over the real rows' logits.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import build_tiny_family

pytestmark = pytest.mark.gpu

VARIANTS = ("coder", "writer", "math")
SHAPE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "max_position_embeddings": 256}
MAX_BATCH, SEQ = 16, 128
REL_TOL = 0.02


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_tiny_family(tmp_path_factory.mktemp("graphs_family"), VARIANTS, **SHAPE)


def _within(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max |got − want|, its bound REL_TOL · max(1, max |want|))``."""
    bound = REL_TOL * max(1.0, want.float().abs().max().item())
    return (got.float() - want.float()).abs().max().item(), bound


def test_graph_replay_matches_the_eager_step(family):
    """Mixed batches of 1, 3 and 5 rows (base and variants, at different positions, in scattered
    cache rows) and a base-only batch of 2, prefilled identically into two copies of one KV cache
    (16 sequence rows and the scratch row), then decoded 4 steps eagerly (``forward_rows``, the
    scheduler's eager path) on one copy and by graph replay (``DecodeGraphs.run``) on the other, both
    fed the eager step's greedy tokens. The 4th step moves each variant row to another variant: the
    captured graph must read the slot tensor written in place. Each step's logits agree within the
    module's bound; afterwards so do the two caches' sequence rows, and the eager cache's scratch row
    is still zero."""
    from deltafleet.compress.bitdelta import load_artifact
    from deltafleet.serve.batch import BatchDeltas, DeltaSlots, RowCache
    from deltafleet.serve.graphs import DecodeGraphs
    from deltafleet.serve.delta import VariantDelta
    from deltafleet.serve.loading import load_model

    model = load_model(family.base_dir, "cuda", torch.bfloat16)
    slots = DeltaSlots(model, len(VARIANTS))
    views = {v: slots.put(VariantDelta(load_artifact(family.artifacts_dir / v), "cuda", torch.bfloat16))
             for v in VARIANTS}
    eager_cache = model.new_cache(MAX_BATCH + 1, SEQ)
    graphs = DecodeGraphs(model, slots, model.new_cache(MAX_BATCH + 1, SEQ))
    dev, vocab = model.device, model.args.vocab_size
    gen = torch.Generator().manual_seed(0)
    order = [-1] + [views[v].slot for v in VARIANTS]  # base → coder → writer → math → base
    cases = [(["coder"], [7]), (["base", "coder", "writer"], [0, 9, 4]),
             (["base", "coder", "writer", "math", "coder"], [1, 3, 15, 6, 11]), (["base", "base"], [2, 12])]
    with torch.inference_mode():
        for models, rows in cases:
            slot_list = [-1 if m == "base" else views[m].slot for m in models]
            tokens, pos = [], []
            for i, (m, r) in enumerate(zip(models, rows)):  # prefill each row, identically in both caches
                prompt = torch.randint(1, vocab, (1, 3 + 2 * i), generator=gen).to(dev)
                for cache in (eager_cache, graphs.cache):
                    view = [RowCache(c, torch.tensor([r], device=dev), per_row_positions=False) for c in cache]
                    logits = model(prompt, torch.arange(prompt.shape[1], device=dev), view,
                                   None if m == "base" else views[m])[0, -1]
                tokens.append(int(logits.argmax()))
                pos.append(prompt.shape[1])
            for step in range(4):
                if step == 3 and any(s >= 0 for s in slot_list):  # other variants, the same captured graph
                    slot_list = [order[(order.index(s) + 1) % len(order)] for s in slot_list]
                delta = (BatchDeltas(slots, torch.tensor(slot_list, device=dev))
                         if any(s >= 0 for s in slot_list) else None)
                want = model.forward_rows(torch.tensor(tokens, device=dev), torch.tensor(pos, device=dev),
                                          eager_cache, torch.tensor(rows, device=dev), delta)
                got = graphs.run(tokens, pos, rows, slot_list).clone()
                err, bound = _within(got, want)
                assert err <= bound, f"{models} (bucket {graphs.bucket(len(rows))}) step {step}: " \
                                     f"max |graph − eager| {err:.3g} > {bound:.3g}"
                tokens, pos = want.argmax(-1).tolist(), [p + 1 for p in pos]
    torch.cuda.synchronize()
    assert graphs.replays == 4 * len(cases)
    for layer, (e, g) in enumerate(zip(eager_cache, graphs.cache)):
        for name in ("k", "v"):
            a, b = getattr(e, name), getattr(g, name)
            err, bound = _within(b[:MAX_BATCH], a[:MAX_BATCH])  # the sequence rows; the last is the scratch row
            assert err <= bound, f"layer {layer} {name} cache: max |graph − eager| {err:.3g} > {bound:.3g}"
            assert not a[MAX_BATCH].any(), f"layer {layer}: the eager step wrote the scratch row"


def test_engine_decodes_every_step_by_graph_replay(family):
    """The engine end to end, ``Engine(..., cuda_graphs=True)`` and ``False``: five greedy requests
    (the base and the three variants) decoded together. With graphs on, the scheduler kept its
    graphs and every decode step was a replay, and at least 3 of the 5 completions equal the eager
    engine's token for token (a bf16 near-tie may flip one greedy choice, after which that sequence
    diverges; the logits test above is the strict one)."""
    from deltafleet.serve.engine import Engine, SamplingParams

    jobs = ["tiny", "tiny-coder", "tiny-writer", "tiny-math", "tiny-coder"]
    prompts = ["def main(", "import os\nimport", "The quick brown", "x = 1 +", "class A:"]
    got, sch = {}, None
    for graphs_on in (True, False):
        engine = Engine(family.base_dir, family.artifacts_dir, family="tiny", device="cuda", dtype="bfloat16",
                        max_batch=8, cuda_graphs=graphs_on)
        results = [None] * len(jobs)

        def complete(i, engine=engine, results=results):
            params = SamplingParams(max_tokens=16, temperature=0)
            results[i] = engine.complete(jobs[i], prompts[i], params).token_ids

        threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(jobs))]
        with engine._gen_lock:  # the scheduler waits until every request is queued: one batch
            for t in threads:
                t.start()
            deadline = time.time() + 120
            while sum(engine.scheduler.waiting().values()) < len(jobs) and time.time() < deadline:
                time.sleep(0.01)
        for t in threads:
            t.join(300)
        assert all(r is not None for r in results), f"cuda_graphs={graphs_on}: a request did not finish"
        got[graphs_on] = results
        if graphs_on:
            sch = engine.scheduler
    assert sch.graphs is not None, "the scheduler fell back to eager decoding (see its log)"
    assert sch.steps > 0 and sch.graphs.replays == sch.steps
    same = sum(a == b for a, b in zip(got[True], got[False]))
    assert same >= 3, f"only {same} of {len(jobs)} completions equal with and without graphs"
