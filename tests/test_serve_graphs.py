"""Decode steps replayed as CUDA graphs (serve/graphs.py, FlexAttention over the paged cache) against
the eager step (gathered SDPA), on a GPU.

``gpu`` tests (``make test-gpu``): a tiny random Llama family (the tests' BPE tokenizer; a base of
width 256, 4 layers, 8 heads / 4 kv heads, so that the Triton mixed-tenant kernels run on their
real paths; three BitDelta variants, ``writer`` also changing norms) loaded on CUDA in bfloat16.
The padding and bucketing that the graphs rely on are tested without a GPU in
tests/test_serve_runner.py.

Tolerance: the graph replays FlexAttention over the paged cache on a batch padded to its bucket,
the eager reference gathers the rows' keys for SDPA: two attention kernels, each accumulating bf16
in its own order, and the linears may run another tile for the padded row count. The two paths then
differ by bf16 roundings through 4 layers (0.14 on logits of about 7 seen on an H200): we allow
``max |graph − eager| ≤ 0.05 · max(1, max |eager|)`` over the real rows' logits. A row that reads a
wrong block of the cache is off by the logits' own size (10.5 seen when the block lists were read
with the wrong strides).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import build_tiny_family, complete_together

pytestmark = pytest.mark.gpu

VARIANTS = ("coder", "writer", "math")
SHAPE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "max_position_embeddings": 512}
MAX_BATCH, SEQ = 16, 512
REL_TOL = 0.05


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_tiny_family(tmp_path_factory.mktemp("graphs_family"), VARIANTS, **SHAPE)


def _loaded(family):
    """The family's base on CUDA in bf16, and slots holding its variants: ``(model, slots, {variant:
    its slot's view})``."""
    from deltafleet.compress.bitdelta import load_artifact
    from deltafleet.serve.batch import DeltaSlots
    from deltafleet.serve.delta import VariantDelta
    from deltafleet.serve.loading import load_model

    model = load_model(family.base_dir, "cuda", torch.bfloat16)
    slots = DeltaSlots(model, len(VARIANTS))
    views = {v: slots.put(VariantDelta(load_artifact(family.artifacts_dir / v), "cuda", torch.bfloat16))
             for v in VARIANTS}
    return model, slots, views


def _within(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(max |got − want|, its bound REL_TOL · max(1, max |want|))``."""
    bound = REL_TOL * max(1.0, want.float().abs().max().item())
    return (got.float() - want.float()).abs().max().item(), bound


def _slots_of(tables: dict, seq: int, start: int, stop: int, bs: int, free: list[int]) -> list[int]:
    table = tables.setdefault(seq, [])
    while len(table) * bs < stop:
        table.append(free.pop())
    return [table[t // bs] * bs + t % bs for t in range(start, stop)]


def _two_runners(family, attention: str, n_blocks: int):
    """The family loaded (:func:`_loaded`) and two runners over it, each with its own cache of
    ``n_blocks`` blocks of 128 slots: eager, and replaying steps of up to 512 tokens as CUDA graphs.
    Returns ``(model, views, eager, graphs)``."""
    from deltafleet.serve.runner import ModelRunner

    model, slots, views = _loaded(family)
    eager = ModelRunner(model, slots, n_blocks, 128, MAX_BATCH, SEQ, attention=attention)
    graphs = ModelRunner(model, slots, n_blocks, 128, MAX_BATCH, SEQ, cuda_graphs=True, attention=attention,
                         prefill_graphs=512)
    return model, views, eager, graphs


def _check(eager, graphs, step, factor: float = 1) -> torch.Tensor:
    """The step's sampled logits by both runners agree within ``factor`` times the module's bound;
    returns the eager ones."""
    want, got = eager.forward(step).float(), graphs.execute(step)
    err, bound = _within(got, want)
    assert err <= factor * bound, (err, factor * bound)
    return want


class _Steps:
    """Builds ``StepInput`` rows over a paged cache of ``n_blocks`` blocks of ``bs`` slots, handed out
    in a seeded random order: ``chunk`` appends a prompt chunk, ``decode`` a decode row (decode rows
    come first in a step)."""

    def __init__(self, n_blocks: int, bs: int, gen: torch.Generator):
        self.bs, self.free, self.tables = bs, torch.randperm(n_blocks, generator=gen).tolist(), {}

    def chunk(self, st, seq: int, ids: list[int], start: int, variant: int = -1) -> None:
        first = len(st.tokens)
        st.tokens += ids
        st.positions += range(start, start + len(ids))
        st.kv_slots += _slots_of(self.tables, seq, start, start + len(ids), self.bs, self.free)
        st.variants += [variant] * len(ids)
        st.chunks.append((first, len(ids), start, list(self.tables[seq])))
        st.sample.append(len(st.tokens) - 1)

    def decode(self, st, seq: int, token: int, pos: int, variant: int = -1) -> None:
        st.tokens.append(token)
        st.positions.append(pos)
        st.kv_slots += _slots_of(self.tables, seq, pos, pos + 1, self.bs, self.free)
        st.variants.append(variant)
        st.tables.append(list(self.tables[seq]))
        st.sample.append(st.n_decode)
        st.n_decode += 1


def test_graph_replay_matches_the_eager_step(family):
    """Mixed batches of 1, 3 and 5 rows (base and variants, prompts of 100 to 300 tokens, so rows span
    2 to 4 blocks of 128 at different depths, the blocks scattered) and a base-only batch of 2,
    prefilled identically into two runners' paged caches, then decoded 4 steps eagerly with the
    gathered-SDPA attention (``ModelRunner.forward``) on one and by graph replay with FlexAttention
    (``DecodeGraphs.run``) on the other, both fed the eager step's greedy tokens. The 4th step moves
    each variant row to another variant: the captured graph must read the slot tensor written in
    place. Each step's logits agree within the module's bound; afterwards so do the two caches."""
    from deltafleet.serve.runner import ModelRunner, StepInput

    model, slots, views = _loaded(family)
    bs, n_blocks = 128, 64
    eager = ModelRunner(model, slots, n_blocks, bs, MAX_BATCH, SEQ, attention="sdpa")
    flex = ModelRunner(model, slots, n_blocks, bs, MAX_BATCH, SEQ, cuda_graphs=True, attention="flex")
    graphs = flex.graphs
    vocab = model.args.vocab_size
    gen = torch.Generator().manual_seed(0)
    free = torch.randperm(n_blocks, generator=gen).tolist()
    tables: dict[int, list[int]] = {}
    order = [-1] + [views[v].slot for v in VARIANTS]  # base → coder → writer → math → base
    cases = [["coder"], ["base", "coder", "writer"], ["base", "coder", "writer", "math", "coder"], ["base", "base"]]
    seq = 0
    with torch.inference_mode():
        for models in cases:
            slot_list = [-1 if m == "base" else views[m].slot for m in models]
            ids, step = [], StepInput()
            for m, sl in zip(models, slot_list):  # one prefill step of every row's prompt, in both runners
                prompt = torch.randint(1, vocab, (int(torch.randint(100, 300, (1,), generator=gen)),),
                                       generator=gen).tolist()
                first = len(step.tokens)
                step.tokens += prompt
                step.positions += range(len(prompt))
                step.kv_slots += _slots_of(tables, seq + len(ids), 0, len(prompt), bs, free)
                step.variants += [sl] * len(prompt)
                step.chunks.append((first, len(prompt), 0, list(tables[seq + len(ids)])))
                step.sample.append(len(step.tokens) - 1)
                ids.append(prompt)
            tokens = eager.forward(step).argmax(-1).tolist()
            flex.forward(step)
            for i, prompt in enumerate(ids):
                prompt.append(tokens[i])
            for k in range(4):
                if k == 3 and any(s >= 0 for s in slot_list):  # other variants, the same captured graph
                    slot_list = [order[(order.index(s) + 1) % len(order)] for s in slot_list]
                step = StepInput(n_decode=len(ids))
                for i, (prompt, sl) in enumerate(zip(ids, slot_list)):
                    p = len(prompt) - 1
                    step.tokens.append(prompt[-1])
                    step.positions.append(p)
                    step.kv_slots += _slots_of(tables, seq + i, p, p + 1, bs, free)
                    step.variants.append(sl)
                    step.tables.append(list(tables[seq + i]))
                step.sample = list(range(len(ids)))
                want = eager.forward(step)
                got = graphs.run(step, any(s >= 0 for s in slot_list)).clone()
                err, bound = _within(got, want)
                assert err <= bound, f"{models} (bucket {graphs.bucket(len(ids))}) step {k}: " \
                                     f"max |graph − eager| {err:.3g} > {bound:.3g}"
                for prompt, t in zip(ids, want.argmax(-1).tolist()):
                    prompt.append(t)
            seq += len(ids)
    torch.cuda.synchronize()
    assert graphs.replays == 4 * len(cases)
    used = sorted(b for t in tables.values() for b in t)
    for name in ("k", "v"):
        a, b = getattr(eager.cache, name), getattr(flex.cache, name)
        for blk in used:
            sl = slice(blk * bs, (blk + 1) * bs)
            err, bound = _within(b[:, :, sl], a[:, :, sl])
            assert err <= bound, f"{name} cache block {blk}: max |graph − eager| {err:.3g} > {bound:.3g}"
        assert not a[:, :, n_blocks * bs:].any(), "the eager step wrote the scratch block"


def test_grouped_decode_graphs_take_each_batchs_block_size(family):
    """Decode batches of 12 rows (a bucket of 16: grouped by variant) by graph replay, once spread
    over the base and three variants (runs of 2 to 4 rows: blocks of 4 on Hopper) and once all on one
    variant (a run of 12: blocks of 16): each replay takes the graph of its block size
    (``DecodeGraphs.block_m``) and agrees with the eager gathered-SDPA step within the module's
    bound."""
    from deltafleet.kernels.gluon_bitdelta import HAVE_GLUON
    from deltafleet.serve.runner import ModelRunner, StepInput

    model, slots, views = _loaded(family)
    # the down projection's K (688) is not a multiple of 128, so the slots would group by 16 for the
    # Triton kernel (DeltaSlots.small_blocks); the others run Hopper's kernel, and blocks of any size
    # are right on both
    slots.small_blocks = True
    bs, n_blocks, rows = 128, 32, 12
    eager = ModelRunner(model, slots, n_blocks, bs, MAX_BATCH, SEQ, attention="sdpa")
    flex = ModelRunner(model, slots, n_blocks, bs, MAX_BATCH, SEQ, cuda_graphs=True, attention="flex")
    gen = torch.Generator().manual_seed(3)
    free = torch.randperm(n_blocks, generator=gen).tolist()
    tables: dict[int, list[int]] = {}
    vocab = model.args.vocab_size
    step, ids = StepInput(), []
    for i in range(rows):  # one prefill step of twelve 40-token prompts on the base
        prompt = torch.randint(1, vocab, (40,), generator=gen).tolist()
        first = len(step.tokens)
        step.tokens += prompt
        step.positions += range(40)
        step.kv_slots += _slots_of(tables, i, 0, 40, bs, free)
        step.variants += [-1] * 40
        step.chunks.append((first, 40, 0, list(tables[i])))
        step.sample.append(len(step.tokens) - 1)
        ids.append(prompt)
    spread = [-1, -1] + [views[VARIANTS[i % 3]].slot for i in range(rows - 2)]
    one = [views["writer"].slot] * rows
    with torch.inference_mode():
        tokens = eager.forward(step).argmax(-1).tolist()
        flex.forward(step)
        for prompt, t in zip(ids, tokens):
            prompt.append(t)
        for variants in (spread, one):
            step = StepInput(n_decode=rows)
            for i, (prompt, v) in enumerate(zip(ids, variants)):
                p = len(prompt) - 1
                step.tokens.append(prompt[-1])
                step.positions.append(p)
                step.kv_slots += _slots_of(tables, i, p, p + 1, bs, free)
                step.variants.append(v)
                step.tables.append(list(tables[i]))
            step.sample = list(range(rows))
            want = eager.forward(step)
            got = flex.graphs.run(step, True).clone()
            err, bound = _within(got, want)
            assert err <= bound, f"variants {variants}: max |graph − eager| {err:.3g} > {bound:.3g}"
            for prompt, t in zip(ids, want.argmax(-1).tolist()):
                prompt.append(t)
    keys = sorted(k for k in flex.graphs.graphs if k[1])
    hopper = torch.cuda.get_device_capability()[0] == 9 and HAVE_GLUON
    assert keys == ([(16, True, 4), (16, True, 16)] if hopper else [(16, True, 16)])  # else the Triton tiles


def test_engine_decodes_every_step_by_graph_replay(family):
    """The engine end to end, ``Engine(..., cuda_graphs=True, prefill_graphs=True,
    capture_at_start=True)`` and ``cuda_graphs=False``: five greedy requests (the base and the three
    variants) decoded together. With graphs on, every bucket was captured before the first request
    (decode and piecewise, base-only and with variants) and none after; the prefill step was a
    piecewise replay and every decode step a replay. The base request's completion equals the eager
    engine's token for token. The variants' prompts are multiplied by the grouped kernel in the
    graph and by the one-variant kernel eagerly, whose bf16 roundings differ; this random tiny model
    has near-ties, so a greedy choice may flip from the first token on (2 of 4 first tokens agreed
    on an H200; another variant's signs, or garbage, would agree by chance, 1 in 512): at least half
    must agree. The logits tests above are the strict ones."""
    from deltafleet.serve.engine import Engine, SamplingParams
    from deltafleet.serve.graphs import buckets, token_buckets

    jobs = ["tiny", "tiny-coder", "tiny-writer", "tiny-math", "tiny-coder"]
    prompts = ["def main(", "import os\nimport", "The quick brown", "x = 1 +", "class A:"]
    got, sch = {}, None
    for graphs_on in (True, False):
        engine = Engine(family.base_dir, family.artifacts_dir, family="tiny", device="cuda", dtype="bfloat16",
                        max_batch=8, cuda_graphs=graphs_on, prefill_graphs=graphs_on, capture_at_start=graphs_on,
                        max_num_batched_tokens=256)
        if graphs_on:
            runner = engine.scheduler.runner
            captured = (sorted(runner.graphs.graphs), sorted(runner.piecewise.graphs))
            assert captured == (sorted((b, v, None) for b in buckets(8) for v in (False, True)),
                                sorted((b, v) for b in token_buckets(256) for v in (False, True)))
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
    assert sch.steps > 1 and sch.graphs.replays == sch.steps - 1  # one prefill step, then decode replays
    assert sch.runner.piecewise.replays == 1
    assert (sorted(sch.runner.graphs.graphs), sorted(sch.runner.piecewise.graphs)) == captured  # none since
    assert got[True][0] == got[False][0]  # the base request: the same kernels either way
    first = sum(a[0] == b[0] for a, b in zip(got[True][1:], got[False][1:]))
    assert first >= 2, f"only {first} of {len(jobs) - 1} variant requests' first tokens equal with and without graphs"


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_step_is_queued_without_waiting_for_the_device(family, kind):
    """Asynchronous scheduling's premise: preparing and launching a step (its inputs through pinned
    memory, a decode row fed the previous step's token on the device, the graph replay: a decode
    graph, or with a variant's prompt chunk FullGraphs' one graph), sampling it (the batch's
    parameters, a banned token, penalties with the token in flight counted on the device, min_p)
    and starting the copy of its tokens to the host all return while the device is still busy with
    earlier work (a kernel spinning for about 0.25 s), with no synchronising CUDA call
    (``torch.cuda.set_sync_debug_mode("error")``); the tokens read afterwards are those of the same
    step run without the wait."""
    from types import SimpleNamespace

    from deltafleet.serve.runner import ModelRunner, StepInput
    from deltafleet.serve.sampling import SamplingBatch, sample
    from deltafleet.serve.scheduler import Scheduler

    model, slots, views = _loaded(family)
    runner = ModelRunner(model, slots, n_blocks=8, block_size=128, max_batch=4, max_seq_len=SEQ, cuda_graphs=True,
                         prefill_graphs=64 if kind == "prefill" else 0)
    coder = views["coder"].slot
    if kind == "decode":  # two rows at position 0 of blocks 1 and 2: each reads back only its own keys
        step = StepInput([0, 5], [0, 0], [1 * 128, 2 * 128], [-1, coder], 2, [[1], [2]],
                         [], [0, 1], prev_rows=[1, -1])  # row 0's token: row 1 of the previous step's
    else:  # a decode row fed on the device at position 0 of block 1, then 20 prompt tokens of the coder in
        # block 0 (not the scratch block, which the graph's padding tokens write at the same position)
        chunk = list(range(5, 25))
        step = StepInput([0] + chunk, [0] + list(range(20)), [1 * 128] + list(range(20)), [-1] + [coder] * 20,
                         1, [[1]], [(1, 20, 0, [0])], [0, 20], prev_rows=[1])
    prev = torch.tensor([3, 9], device="cuda")
    params = [(0.0, 1.0, 0, 1, 1), (0.8, 0.9, 0, 2, 1)]  # greedy; seeded top-p
    host = SimpleNamespace(_launches=0, _pinned=[], max_batch=4, _clock=None)  # what Scheduler._copy_out keeps

    def launch():
        logits = runner.execute(step, prev)
        batch = SamplingBatch.build(params, "cuda", banned=[(0, 7)], penalties=[(1, 5, 0, 1.2, 0.0, 0.0)],
                                    min_p=[0.0, 0.05], fed=([(0, 1, 1.1, 0.5, 0.0)], prev))
        return Scheduler._copy_out(host, sample(logits, batch))

    with torch.inference_mode():
        want = Scheduler._read(launch())[0]  # captures the graph, compiles the sampler
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e8))
        busy = torch.cuda.Event()
        busy.record()
        t0 = time.perf_counter()
        torch.cuda.set_sync_debug_mode("error")
        try:
            copy = launch()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        queued = time.perf_counter() - t0
        assert not busy.query(), f"launching the step waited for the device ({queued:.3f} s)"
        got = Scheduler._read(copy)[0]
    graphs = runner.graphs if kind == "decode" else runner.piecewise
    assert graphs is not None and graphs.replays == 2
    assert got == want and len(got) == 2


def test_async_scheduling_replays_the_same_steps(family):
    """With graphs on, asynchronous scheduling (decode rows fed the previous step's tokens on the device,
    inside the replayed steps' static inputs) and synchronous scheduling run the same batches: five
    requests of the base and the variants, to max_tokens, give the same tokens bit for bit, every
    decode step a replay and, asynchronously, fed on the device (the first by the prefill step)."""
    from deltafleet.serve.engine import Engine, SamplingParams

    jobs = ["tiny", "tiny-coder", "tiny-writer", "tiny-math", "tiny-coder"]
    prompts = ["def main(", "import os\nimport", "The quick brown", "x = 1 +", "class A:"]
    params = SamplingParams(max_tokens=12, temperature=0.7, seed=11, ignore_eos=True)
    got, fed = {}, {}
    for async_on in (True, False):
        engine = Engine(family.base_dir, family.artifacts_dir, family="tiny", device="cuda", dtype="bfloat16",
                        max_batch=8, max_num_batched_tokens=256, capture_at_start=True, async_scheduling=async_on)
        runner, rows = engine.scheduler.runner, []
        real = runner.execute
        runner.execute = lambda step, prev=None: rows.append(sum(r >= 0 for r in step.prev_rows)) or real(step, prev)
        results = complete_together(engine, [(m, p, params) for m, p in zip(jobs, prompts)])
        sch = engine.scheduler
        assert sch.graphs is not None and sch.graphs.replays == sch.steps - 1 == 11
        got[async_on], fed[async_on] = results, rows
    assert got[True] == got[False] and all(len(r) == 12 for r in got[True])
    assert fed[False] == [0] * 12 and fed[True] == [0] + [len(jobs)] * 11


@pytest.mark.parametrize("attention", ["flex", "sdpa"])
def test_piecewise_graphs_match_the_eager_step(family, attention):
    """Steps with prefill chunks by CUDA graphs (``ModelRunner.execute`` with ``prefill_graphs``: with
    FlexAttention one graph a step, ``FullGraphs``; with SDPA one graph a segment, ``PiecewiseGraphs``)
    and eagerly (``ModelRunner.forward``) on two runners with their own caches:
    base-only steps (two new prompts of 150 and 90 tokens; then two decode rows beside a third
    prompt's first chunk; then its second chunk), then steps with variants (a coder prompt of 200
    tokens beside a writer's 40 and a base decode row: 241 tokens, grouped by variant; then a coder
    decode row beside a math prompt of 6: 7 tokens, per-row kernels eagerly and grouped in the graph
    of 16; then a base and a coder decode row beside prompts of the base (20), coder (150) and math
    (300): 472 tokens, the eager step multiplying the prompts by tiles of one variant each where the
    kernel runs, its base prompt with the decode rows, and the graph of 512 grouping). The sampled
    rows' logits agree within the module's bound (twice that for the last step: see there), each
    (bucket, with variants) pair is captured once (piecewise: one graph per segment, 5 for 4 layers)
    and replayed, and afterwards the caches agree."""
    from deltafleet.serve.graphs import FullGraphs
    from deltafleet.serve.batch import GROUPED_MIN_ROWS
    from deltafleet.serve.runner import StepInput

    bs, n_blocks = 128, 32
    model, views, eager, piece = _two_runners(family, attention, n_blocks)
    pw = piece.piecewise
    assert pw is not None and pw.buckets == [16, 32, 64, 128, 256, 320, 384, 448, 512]
    assert isinstance(pw, FullGraphs) == (attention == "flex")
    gen = torch.Generator().manual_seed(1)
    steps = _Steps(n_blocks, bs, gen)
    chunk, decode = steps.chunk, steps.decode
    vocab = model.args.vocab_size
    prompts = {s: torch.randint(1, vocab, (n,), generator=gen).tolist()
               for s, n in ((0, 150), (1, 90), (2, 200), (3, 200), (4, 40), (5, 6), (6, 20), (7, 150), (8, 300))}

    def check(st, factor=1):
        return _check(eager, piece, st, factor)

    coder, writer, maths = (views[v].slot for v in ("coder", "writer", "math"))
    with torch.inference_mode():
        one = StepInput()
        chunk(one, 0, prompts[0], 0)
        chunk(one, 1, prompts[1], 0)
        want = check(one)
        assert list(pw.graphs) == [(256, False)]
        graphs = pw.graphs[256, False]
        assert isinstance(graphs, torch.cuda.CUDAGraph) if attention == "flex" else len(graphs) == len(model.layers) + 1
        two = StepInput()
        for seq in (0, 1):
            decode(two, seq, int(want[seq].argmax()), len(prompts[seq]))
        chunk(two, 2, prompts[2][:120], 0)
        check(two)
        three = StepInput()
        chunk(three, 2, prompts[2][120:], 120)
        check(three)
        four = StepInput()  # variants, grouped: 241 tokens
        decode(four, 0, 7, len(prompts[0]) + 1)
        chunk(four, 3, prompts[3], 0, coder)
        chunk(four, 4, prompts[4], 0, writer)
        assert len(four.tokens) >= GROUPED_MIN_ROWS
        want = check(four)
        five = StepInput()  # a variant's decode row beside another's prompt: per-row kernels eagerly
        decode(five, 3, int(want[1].argmax()), len(prompts[3]), coder)
        chunk(five, 5, prompts[5], 0, maths)
        assert len(five.tokens) < GROUPED_MIN_ROWS
        want = check(five)
        six = StepInput()  # prompts by tiles: a bucket of 512
        decode(six, 0, 9, len(prompts[0]) + 2)
        decode(six, 5, int(want[1].argmax()), len(prompts[5]), maths)
        chunk(six, 6, prompts[6], 0)
        chunk(six, 7, prompts[7], 0, coder)
        chunk(six, 8, prompts[8], 0, maths)
        # down's K (688) is no multiple of 128: no tile kernel for it, so the graph groups (a graph
        # cannot take the tiles one by one); the eager step takes the tiles where the kernel runs.
        # Every variant row's product then differs in its roundings (W + α·s in bf16 against the
        # base product rounded before the sign term), through every layer: twice the bound (0.31 on
        # logits of about 6 seen on an H200 with SDPA)
        assert pw.bucket(len(six.tokens)) == 512 and not pw.segmented(512)
        check(six, factor=2)
    assert pw.replays == 6 and sorted(pw.graphs) == [(16, True), (128, False), (256, False), (256, True), (512, True)]
    # The caches' blocks that the sequences own hold every layer's keys of the variant steps too,
    # where the eager step multiplies a variant's chunk by the one-variant kernel and the graph by the
    # grouped one (which rounds the base product before adding the sign term): their roundings
    # compound through the layers (0.47 on values of about 9 seen on an H200), so twice the logits'
    # bound; a misplaced write is off by the values' own size. The scratch block past them is the
    # padding tokens' (the graph's), never the eager step's.
    used = sorted(b for t in steps.tables.values() for b in t)
    for name in ("k", "v"):
        c_e, c_p = getattr(eager.cache, name), getattr(piece.cache, name)
        for blk in used:
            sl = slice(blk * bs, (blk + 1) * bs)
            err, bound = _within(c_p[:, :, sl], c_e[:, :, sl])
            assert err <= 2 * bound, f"{name} cache block {blk}: max |graph − eager| {err:.3g} > {2 * bound:.3g}"
        assert not c_e[:, :, n_blocks * bs:].any(), "the eager step wrote the scratch block"


@pytest.fixture(scope="module")
def family128(tmp_path_factory):
    """The module's family with an MLP width of 768: every linear's K a multiple of 128, so that the
    tile kernel runs for every linear of a layer on Hopper."""
    return build_tiny_family(tmp_path_factory.mktemp("graphs_family128"), VARIANTS,
                             **(SHAPE | {"intermediate_size": 768}))


@pytest.mark.parametrize("attention", ["flex", "sdpa"])
def test_prompt_chunks_replay_by_tiles(family128, attention):
    """Steps of 512 tokens with several variants' prompt chunks by CUDA graphs whose linears take the
    prompt rows by tiles of one variant each (``segmented``: ``bitdelta_linear_segments`` in the
    graph, the first ``decode_rows`` rows as a decode batch) against the eager step: prompts of the
    base (200), coder (200) and math (60), 460 tokens; then their three decode rows beside prompts of
    the writer (300), coder (120) and base (30), replaying the same graph with another tile table.
    Logits agree within the module's bound, one graph serves both steps, and the caches agree."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the tile kernel runs on Hopper only")
    from deltafleet.serve.runner import StepInput

    n_blocks = 16
    model, views, eager, piece = _two_runners(family128, attention, n_blocks)
    pw = piece.piecewise
    assert pw.segmented(512) and not pw.segmented(256)
    gen = torch.Generator().manual_seed(2)
    steps = _Steps(n_blocks, 128, gen)
    vocab = model.args.vocab_size
    sizes = {0: 200, 1: 200, 2: 60, 3: 300, 4: 120, 5: 30}  # both steps in the 512-token bucket (449–512)
    prompts = {s: torch.randint(1, vocab, (n,), generator=gen).tolist() for s, n in sizes.items()}
    coder, writer, maths = (views[v].slot for v in ("coder", "writer", "math"))

    with torch.inference_mode():
        one = StepInput()
        for seq, variant in sorted(((0, -1), (1, coder), (2, maths)), key=lambda c: c[1]):  # the scheduler's order
            steps.chunk(one, seq, prompts[seq], 0, variant)
        assert pw.bucket(len(one.tokens)) == 512
        want = _check(eager, piece, one)
        two = StepInput()
        for row, (seq, variant) in enumerate(((0, -1), (1, coder), (2, maths))):
            steps.decode(two, seq, int(want[row].argmax()), sizes[seq], variant)
        for seq, variant in sorted(((3, writer), (4, coder), (5, -1)), key=lambda c: c[1]):
            steps.chunk(two, seq, prompts[seq], 0, variant)
        assert pw.bucket(len(two.tokens)) == 512
        _check(eager, piece, two)
    assert pw.replays == 2 and sorted(pw.graphs) == [(512, True)]
    for c_e, c_p in ((eager.cache.k, piece.cache.k), (eager.cache.v, piece.cache.v)):
        err, bound = _within(c_p, c_e)
        assert err <= 2 * bound, (err, 2 * bound)
