"""The model runner over the paged KV cache (serve/runner.py, serve/attention.py, serve/graphs.py):
a step mixing decode rows and prefill chunks of different variants gives each sequence's logits of
running it alone; both decode attention backends agree; a padded (CUDA-graph) step gives the real
rows' logits and writes nothing but the scratch block; and through the scheduler, long prompts in
chunks and preempted sequences still give exactly what each request gives alone."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deltafleet.serve.engine import Engine, SamplingParams
from deltafleet.serve.model import DeltaLinear
from deltafleet.serve.runner import ModelRunner, StepInput
from tests.conftest import complete_together

PROMPTS = {"tiny": "def main(", "tiny-coder": "import os\nimport", "tiny-writer": "The quick brown"}
BS = 4  # tokens a block: small, so sequences span several blocks


@pytest.fixture(scope="module")
def eng(tiny_family) -> Engine:
    return Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", max_batch=1)


def _alone(engine: Engine, model_id: str, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids`` run alone, without a cache: the reference."""
    with torch.inference_mode():
        return engine.model(torch.tensor([ids]), torch.arange(len(ids)), None, engine.get_delta(model_id))[0]


class _Tables:
    """Block tables handed out by hand: sequence i gets blocks as it grows, interleaved with the others'."""

    def __init__(self):
        self.tables: dict[int, list[int]] = {}
        self.next = 0

    def slots(self, seq: int, start: int, stop: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * BS < stop:
            table.append(self.next)
            self.next += 1
        return [table[t // BS] * BS + t % BS for t in range(start, stop)]


def _step(tables: _Tables, decode: list[tuple[int, int, int, int]], chunks: list[tuple[int, list[int], int, int]]):
    """A StepInput of decode rows ``(seq, token, position, variant)`` then chunks ``(seq, ids, start, variant)``;
    every decode row and every chunk samples."""
    st = StepInput()
    for seq, tok, pos, var in decode:
        st.tokens.append(tok)
        st.positions.append(pos)
        st.kv_slots += tables.slots(seq, pos, pos + 1)
        st.variants.append(var)
        st.tables.append(list(tables.tables[seq]))
    st.n_decode = len(decode)
    st.sample = list(range(st.n_decode))
    for seq, ids, start, var in chunks:
        first = len(st.tokens)
        st.tokens += ids
        st.positions += range(start, start + len(ids))
        st.kv_slots += tables.slots(seq, start, start + len(ids))
        st.variants += [var] * len(ids)
        st.chunks.append((first, len(ids), start, list(tables.tables[seq])))
        st.sample.append(len(st.tokens) - 1)
    return st


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_decode_rows_and_prefill_chunks_of_mixed_variants_in_one_step(eng, backend):
    """Three sequences of three models: A prefilled whole, B in two chunks, C joining late; steps mix
    decode rows and chunks; every sampled row's logits equal the sequence's own, run alone."""
    runner = ModelRunner(eng.model, eng.slots, n_blocks=32, block_size=BS, max_batch=4, max_seq_len=64,
                         attention=backend)
    slot = {m: -1 if eng.get_delta(m) is None else eng.get_delta(m).slot for m in PROMPTS}
    ids = {m: eng.encode_prompt(PROMPTS[m] * 2) for m in PROMPTS}  # 6 to 10 tokens
    a, b, c = "tiny", "tiny-coder", "tiny-writer"
    t = _Tables()
    seqs = {a: list(ids[a]), b: list(ids[b]), c: list(ids[c])}
    with torch.inference_mode():
        # step 1: A's whole prompt, B's first 5 tokens
        out = runner.forward(_step(t, [], [(0, seqs[a], 0, slot[a]), (1, seqs[b][:5], 0, slot[b])]))
        torch.testing.assert_close(out[0], _alone(eng, a, seqs[a])[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out[1], _alone(eng, b, seqs[b][:5])[-1], rtol=1e-4, atol=1e-4)
        seqs[a].append(int(out[0].argmax()))
        # step 2: A decodes; the rest of B's prompt (from position 5); all of C
        n = len(seqs[a]) - 1
        out = runner.forward(_step(t, [(0, seqs[a][-1], n, slot[a])],
                                   [(1, seqs[b][5:], 5, slot[b]), (2, seqs[c], 0, slot[c])]))
        for row, m in enumerate((a, b, c)):
            torch.testing.assert_close(out[row], _alone(eng, m, seqs[m])[-1], rtol=1e-4, atol=1e-4)
            seqs[m].append(int(out[row].argmax()))
        # steps 3…: all three decode, crossing block boundaries
        for _ in range(6):
            rows = [(i, seqs[m][-1], len(seqs[m]) - 1, slot[m]) for i, m in enumerate((a, b, c))]
            out = runner.forward(_step(t, rows, []))
            for row, m in enumerate((a, b, c)):
                torch.testing.assert_close(out[row], _alone(eng, m, seqs[m])[-1], rtol=1e-4, atol=1e-4)
                seqs[m].append(int(out[row].argmax()))
    assert len({tuple(s[-6:]) for s in seqs.values()}) == 3  # the models really differ


@pytest.mark.parametrize("mask_block", [BS, BS // 2, 1], ids=["page", "half-page", "one-key"])
def test_the_backends_agree_on_a_partial_last_block(eng, monkeypatch, mask_block):
    """FlexAttention's block mask (every mask block whole but the one at the row's position, read to
    it) against gathering the rows' keys for SDPA, on rows whose last blocks are filled to different
    depths, with mask blocks of a whole cache block or a part of one."""
    from deltafleet.serve import attention
    from deltafleet.serve.attention import FlexMask, PagedKVCache, PagedStep, decode_sdpa

    monkeypatch.setattr(attention, "FLEX_MASK_BLOCK", mask_block)
    monkeypatch.setattr(attention, "FLEX_MASK_BLOCK_FEW", mask_block)
    assert attention.mask_block(BS) == attention.mask_block(BS, 3) == mask_block
    torch.manual_seed(0)
    cache = PagedKVCache(1, 2, 16, n_blocks=12, block_size=BS, dtype=torch.float32, device="cpu")
    cache.k.normal_()
    cache.v.normal_()
    tables = torch.tensor([[3, 7, 1], [0, 5, 5], [9, 2, 11]], dtype=torch.int32)
    positions = torch.tensor([9, 4, 11])  # 2 blocks + 2, 1 block + 1, 3 full blocks
    num_blocks = (positions // BS + 1).to(torch.int32)
    q = torch.randn(3, 4, 1, 16)  # 4 query heads over 2 key/value heads
    step = PagedStep(cache, torch.zeros(0, dtype=torch.int64), 3, tables, num_blocks, positions, [], "flex",
                     FlexMask(12, BS, 3, "cpu"))
    got = step.layer(0)._decode(q, cache.k[0], cache.v[0])
    want = decode_sdpa(q, cache.k[0], cache.v[0], tables, positions, BS)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # by hand for row 1: its keys are block 0 (positions 0-3) and slot 0 of block 5 (position 4)
    keys = torch.cat([cache.k[0][:, 0:4], cache.k[0][:, 20:21]], 1).repeat_interleave(2, 0)  # [4, 5, 16]
    vals = torch.cat([cache.v[0][:, 0:4], cache.v[0][:, 20:21]], 1).repeat_interleave(2, 0)
    att = torch.softmax(q[1] @ keys.transpose(1, 2) / 4.0, -1) @ vals
    torch.testing.assert_close(got[1], att, rtol=1e-5, atol=1e-5)


def test_the_block_lists_share_one_shape_and_name_each_rows_blocks():
    """FlexAttention's kernels read the full-block list with the partial list's strides: a partial list
    of one column beside tables of four read other rows' blocks (seen on an H200: logits off by 10)."""
    from deltafleet.serve.attention import block_lists

    tables = torch.tensor([[3, 7, 1, 0], [0, 5, 0, 0], [9, 2, 11, 4]], dtype=torch.int32)
    positions = torch.tensor([9, 4, 13])
    partial, full, n_full = block_lists(tables, positions, BS)
    assert partial.shape == full.shape == (3, 4) and partial.stride() == full.stride()
    assert partial[:, 0].tolist() == [1, 5, 4] and full.tolist() == tables.tolist()
    assert n_full.tolist() == [2, 1, 3]
    wide, _, _ = block_lists(tables, positions, BS, width=13)
    assert wide.shape == (3, 13) and wide[:, 0].tolist() == [1, 5, 4] and not wide[:, 4:].any()
    # mask blocks of half a cache block: cache block t is mask blocks 2t, 2t + 1
    half = BS // 2
    partial, full, n_full = block_lists(tables, positions, BS, half)
    assert partial.shape == full.shape == (3, 8) and partial.stride() == full.stride()
    assert full[0].tolist() == [6, 7, 14, 15, 2, 3, 0, 1]
    assert n_full.tolist() == [p // half for p in positions.tolist()]
    # each row's partial block is the mask block holding its position
    assert partial[:, 0].tolist() == [2 * int(tables[i, p // BS]) + (p % BS) // half
                                      for i, p in enumerate(positions.tolist())]


def test_the_prefill_lists_read_each_chunks_blocks_whole_only_where_every_query_sees_them(monkeypatch):
    """FlexAttention's lists for the prefill tokens, query blocks of 4 tokens here: a query block of one
    chunk reads the blocks wholly before its first token whole and the rest through the mask; one
    holding two chunks reads all of both through the mask; padding tokens see nothing."""
    from deltafleet.serve import attention
    from deltafleet.serve.attention import prefill_length, prefill_lists

    monkeypatch.setattr(attention, "PREFILL_Q_BLOCK", 4)
    assert [prefill_length(n) for n in (1, 16, 17, 100)] == [16, 16, 32, 128]
    # after 2 decode rows: chunk 0 continues its sequence at position 9 (blocks 3, 7, 1 of 4 tokens),
    # 6 tokens; chunk 1 is a whole 3-token prompt in block 5
    h = prefill_lists([(2, 6, 9, [3, 7, 1, 0]), (8, 3, 0, [5])], 2, 12, BS, first_owner=4)
    assert h["length"] == 16 and h["kv_idx"].shape == h["full_idx"].shape == (4, 12)
    assert h["seq"].tolist() == [4] * 6 + [5] * 3 + [-1] * 7
    assert h["pos"][:9].tolist() == [9, 10, 11, 12, 13, 14, 0, 1, 2]
    # query block 0: positions 9-12 of chunk 0: blocks 3, 7 whole (keys 0-7 ≤ 9), 1 and 0 masked
    assert h["full_num"][0] == 2 and h["full_idx"][0, :2].tolist() == [3, 7]
    assert h["kv_num"][0] == 2 and h["kv_idx"][0, :2].tolist() == [1, 0]
    # query block 1: positions 13, 14 of chunk 0 and 0, 1 of chunk 1: everything masked
    assert h["full_num"][1] == 0 and h["kv_idx"][1, :h["kv_num"][1]].tolist() == [3, 7, 1, 0, 5]
    # query block 2: position 2 of chunk 1 and padding; block 3: padding only
    assert h["kv_idx"][2, :h["kv_num"][2]].tolist() == [5] and h["full_num"][2] == 0
    assert h["kv_num"][3] == h["full_num"][3] == 0
    assert h["blocks"].tolist() == [3, 7, 1, 0, 5] and h["owners"].tolist() == [4, 4, 4, 4, 5]
    assert h["logical"].tolist() == [0, 1, 2, 3, 0]


@pytest.mark.parametrize("q_block", [4, 128], ids=["q-block-4", "q-block-128"])
def test_flex_prefill_over_query_blocks_gives_each_sequences_own_logits(eng, monkeypatch, q_block):
    """The prefill tokens' FlexAttention over the cache (eager here), with query blocks that hold one
    chunk (blocks read whole) or several: two continuing chunks and a whole prompt beside a decode row
    give every sequence's logits of running it alone."""
    from deltafleet.serve import attention

    monkeypatch.setattr(attention, "PREFILL_Q_BLOCK", q_block)
    runner = ModelRunner(eng.model, eng.slots, n_blocks=32, block_size=BS, max_batch=4, max_seq_len=64,
                         attention="flex")
    ids = {m: eng.encode_prompt(PROMPTS[m] * 3) for m in PROMPTS}
    a, b, c = ids["tiny"], ids["tiny-coder"], ids["tiny-writer"]
    coder = eng.get_delta("tiny-coder").slot
    t = _Tables()
    with torch.inference_mode():
        out = runner.forward(_step(t, [], [(0, a[:9], 0, -1), (1, b[:6], 0, coder)]))
        nxt = int(out[0].argmax())
        seqs = {0: a[:9] + [nxt], 1: b, 2: c}
        step = _step(t, [(0, nxt, 9, -1)], [(1, b[6:], 6, coder), (2, c, 0, -1)])
        out = runner.forward(step)
    assert out.shape[0] == 3
    for row, (i, m) in enumerate(((0, "tiny"), (1, "tiny-coder"), (2, "tiny"))):
        torch.testing.assert_close(out[row], _alone(eng, m, seqs[i])[-1], rtol=1e-4, atol=1e-4)


def test_buckets_and_the_padded_static_inputs(eng):
    from deltafleet.serve.graphs import DecodeGraphs, buckets

    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(12) == [1, 2, 4, 8, 12]
    assert eng.scheduler.graphs is None  # the CPU path is the eager one
    runner = ModelRunner(eng.model, eng.slots, n_blocks=10, block_size=BS, max_batch=5, max_seq_len=12)
    g = DecodeGraphs(runner)
    assert g.max_batch == 5 and g.buckets == [1, 2, 4, 5] and g.tables.shape == (5, 3)
    assert not g.capturable(False) and not g.capturable(True)  # graphs are for CUDA only
    step = StepInput([7, 8, 9], [3, 4, 9], [3, 20, 9], [1, -1, 0], 3, [[0], [5, 6], [1, 0, 2]], [], [0, 1, 2])
    assert g.pad(step) == 4
    scratch = runner.cache.scratch_block
    assert scratch == 10
    assert g.static[:, :4].tolist() == [[7, 8, 9, 0], [3, 4, 9, 0], [3, 20, 9, 40], [1, -1, 0, -1], [-1] * 4]
    assert g.tables[:4].tolist() == [[0, 0, 0], [5, 6, 0], [1, 0, 2], [10, 10, 10]]
    with pytest.raises(ValueError, match="a decode batch has 1 to 5 rows, got 6"):
        g.pad(StepInput([1] * 6, [0] * 6, list(range(6)), [-1] * 6, 6, [[i] for i in range(6)], [], []))
    with pytest.raises(ValueError, match="prefill chunks"):
        g.pad(StepInput([1], [0], [0], [-1], 0, [], [(0, 1, 0, [0])], [0]))


@pytest.mark.parametrize("with_deltas", [True, False], ids=["mixed", "base"])
def test_a_padded_step_gives_the_real_rows_and_writes_only_the_scratch_block(eng, with_deltas):
    """What a graph replays, run eagerly on the CPU: 3 rows padded to 4 give the logits and cache of
    the unpadded step; the padding row writes the base's pad token at position 0 of the scratch
    block and nothing else."""
    from deltafleet.serve.graphs import DecodeGraphs

    models = list(PROMPTS)
    slot = {m: (eng.get_delta(m).slot if with_deltas and eng.get_delta(m) is not None else -1) for m in models}
    assert (sorted(slot.values()) == [-1, 0, 1]) == with_deltas
    runners = [ModelRunner(eng.model, eng.slots, n_blocks=16, block_size=BS, max_batch=6, max_seq_len=32)
               for _ in range(2)]
    eager, padded = runners
    g = DecodeGraphs(padded)
    g.pad_token = 5  # not 0: the pad token's embedding row is zero, and so would be its keys/values
    t = _Tables()
    seqs = [eng.encode_prompt(PROMPTS[m])[:n] for m, n in zip(models, (5, 9, 7))]
    with torch.inference_mode():
        prefill = _step(t, [], [(i, s, 0, slot[m]) for i, (m, s) in enumerate(zip(models, seqs))])
        nxt = eager.forward(prefill).argmax(-1).tolist()
        padded.forward(prefill)
        for _ in range(3):
            for s, tok in zip(seqs, nxt):
                s.append(tok)
            step = _step(t, [(i, s[-1], len(s) - 1, slot[m]) for i, (m, s) in enumerate(zip(models, seqs))], [])
            want = eager.forward(step)
            b = g.pad(step)
            got = g.forward_padded(b, with_deltas)
            assert b == 4 and got.shape == (4, eng.model.args.vocab_size)
            torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
            nxt = want.argmax(-1).tolist()
        alone = _alone(eng, "tiny", [5])[0]  # the padding row: the base on the pad token at position 0
    torch.testing.assert_close(got[3], alone, rtol=1e-5, atol=1e-5)
    used = t.next * BS  # slots of the blocks handed out
    scratch = padded.cache.scratch_block * BS
    for name in ("k", "v"):
        a, p = getattr(eager.cache, name), getattr(padded.cache, name)
        torch.testing.assert_close(p[:, :, :used], a[:, :, :used], rtol=1e-5, atol=1e-5)
        assert not a[:, :, used:].any() and not p[:, :, used:scratch].any()  # no other block written
        assert p[:, :, scratch].abs().sum() > 0 and not p[:, :, scratch + 1:].any()  # position 0 only


# ------------------------------------------------------------------ through the scheduler


def test_long_prompts_in_chunks_and_preempted_sequences_give_what_they_give_alone(tiny_family, eng):
    """A step budget of 12 tokens (prompts of about 20 and 40 tokens are prefilled over several steps
    beside the running streams) and a cache of 24 blocks of 4 tokens (less than the six sequences need
    at once as they grow: the latest admitted are preempted and recomputed): every request gives its
    tokens alone."""
    text = "The quick brown fox. "
    jobs = [(m, text * (1 + i % 2), SamplingParams(max_tokens=24, temperature=0)) for i, m in enumerate(PROMPTS)]
    jobs += [(m, p, SamplingParams(max_tokens=24, temperature=0.8, seed=3)) for m, p, _ in jobs]
    want = [eng.complete(m, p, s).token_ids for m, p, s in jobs]
    small = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", max_batch=6,
                   max_num_batched_tokens=12, kv_cache={"block_size": BS, "max_tokens": 24 * BS})
    prompt_lens = [len(eng.encode_prompt(p)) for _, p, _ in jobs]
    assert max(prompt_lens) > 12 and sum(prompt_lens) + 24 * len(jobs) > 24 * BS
    got = complete_together(small, jobs)
    assert got == want
    sch = small.scheduler
    assert sch.preemptions > 0 and sch.max_rows_seen >= 2
    assert sch.pool.free_blocks == 24 and not sch.running  # every block back
    from fastapi.testclient import TestClient

    from deltafleet.serve.app import create_app

    with TestClient(create_app(small)) as tc:  # what /metrics tells of it
        samples = dict(line.rsplit(" ", 1) for line in tc.get("/metrics").text.splitlines()
                       if line and not line.startswith("#"))
    assert float(samples["deltafleet:kv_cache_usage_perc"]) == 0.0
    assert float(samples["deltafleet:num_preemptions_total"]) == sch.preemptions
    # prompts 5 tokens a step at most (long_prefill_token_threshold): more, smaller chunks, same tokens
    capped = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", max_batch=6,
                    max_num_batched_tokens=12, long_prefill_token_threshold=5)
    planner, chunks = capped.scheduler.planner, []
    schedule = planner.schedule
    planner.schedule = lambda: (plan := schedule(), chunks.extend(b - a for _, a, b in plan.prefill))[0]
    assert complete_together(capped, jobs) == want
    assert max(chunks) == 5


def test_the_context_is_capped_at_the_cache_and_bad_options_are_named(tiny_family):
    def engine(**kw):
        return Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", **kw)

    small = engine(max_batch=2, kv_cache={"block_size": 8, "max_tokens": 100})
    assert small.kv_tokens == 96 and small.max_model_len == 96  # whole blocks within the cap: 12
    assert small.scheduler.planner.token_budget == 2048
    bad = [({"blocksize": 8}, "unknown kv_cache option\\(s\\): blocksize"),
           ({"block_size": 0}, "kv_cache.block_size must be an integer ≥ 1, got 0"),
           ({"block_size": "abc"}, "kv_cache.block_size must be an integer ≥ 1, got 'abc'"),
           ({"max_tokens": 0}, "kv_cache.max_tokens must be null or an integer ≥ kv_cache.block_size \\(128\\), got 0"),
           ({"gpu_memory_utilization": 7}, "kv_cache.gpu_memory_utilization must be a number in \\(0, 1\\], got 7"),
           # found by a fresh user: these were coerced (a block size of 1, of 64) and served
           ({"block_size": True}, "kv_cache.block_size must be an integer ≥ 1, got True"),
           ({"block_size": 64.9}, "kv_cache.block_size must be an integer ≥ 1, got 64.9"),
           ({"gpu_memory_utilization": True}, "kv_cache.gpu_memory_utilization must be a number in \\(0, 1\\], got True")]
    for opts, message in bad:
        with pytest.raises(ValueError, match=message):
            engine(kv_cache=opts)
    with pytest.raises(ValueError, match="attention must be one of"):
        engine(attention="flash")
    assert engine(max_batch=4, max_num_batched_tokens=2).scheduler.planner.token_budget == 4  # raised, logged
    # found by a fresh user: a block size compiled FlexAttention cannot tile started a server on the
    # CPU, where SDPA takes any size, and would have failed at the first step on a GPU
    assert engine(max_batch=2, kv_cache={"block_size": 3}).kv_tokens % 3 == 0
    from deltafleet.serve.attention import check_block_size

    cuda = torch.device("cuda")  # only the rule: no device is touched
    for size in (3, 8, 48, 96, 100):
        with pytest.raises(ValueError, match=f"kv_cache.block_size must be a power of two ≥ 16 with FlexAttention "
                                             f"on CUDA \\(16, 32, 64, 128, …\\), got {size}$"):
            check_block_size(size, "flex", cuda)
    for size in (16, 32, 128, 256):
        check_block_size(size, "flex", cuda)
    check_block_size(3, "sdpa", cuda)
    check_block_size(3, "flex", torch.device("cpu"))  # eager FlexAttention, as the CPU tests run it


def test_adjacent_chunks_of_one_variant_run_as_one_and_answer_as_alone(eng, monkeypatch):
    """Four prompts, two per variant, side by side: ``StepInput.runs`` merges each variant's adjacent
    chunks into one run (one one-variant call per layer and linear for both prompts), and every
    prompt's logits are still its own."""
    from deltafleet.serve import batch

    runner = ModelRunner(eng.model, eng.slots, n_blocks=32, block_size=BS, max_batch=4, max_seq_len=64)
    coder, writer = (eng.get_delta(m).slot for m in ("tiny-coder", "tiny-writer"))
    prompts = [("tiny-coder", "def f(x):", coder), ("tiny-coder", "import sys", coder),
               ("tiny-writer", "Once upon", writer), ("tiny-writer", "The sea", writer)]
    t = _Tables()
    step = _step(t, [], [(i, eng.encode_prompt(p), 0, v) for i, (_, p, v) in enumerate(prompts)])
    n = [len(eng.encode_prompt(p)) for _, p, _ in prompts]
    assert step.runs() == [(0, n[0] + n[1], coder), (n[0] + n[1], sum(n), writer)]
    calls = []
    real = batch.bitdelta_linear
    monkeypatch.setattr(batch, "bitdelta_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    with torch.inference_mode():
        out = runner.forward(step)
    linears = sum(1 for m in eng.model.layers.modules() if isinstance(m, DeltaLinear))  # the head: sampled rows only
    assert len(calls) == 2 * linears and set(calls) == {n[0] + n[1], n[2] + n[3]}
    for row, (m, p, _) in enumerate(prompts):
        torch.testing.assert_close(out[row], _alone(eng, m, eng.encode_prompt(p))[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_whole_prompts_of_one_length_attend_in_one_call_beside_decode_rows(eng, backend):
    """A step with a decode row, three whole prompts of one length (three variants), one of another
    length, and a continuing chunk: with SDPA the equal prompts are one batched attention call over
    their own keys (FlexAttention takes every chunk in one call), and every row's logits equal its
    sequence's own."""
    runner = ModelRunner(eng.model, eng.slots, n_blocks=32, block_size=BS, max_batch=4, max_seq_len=64,
                         attention=backend)
    slot = {m: -1 if eng.get_delta(m) is None else eng.get_delta(m).slot for m in PROMPTS}
    ids = {m: eng.encode_prompt(PROMPTS[m] * 3) for m in PROMPTS}
    n = min(len(v) for v in ids.values()) - 1
    a, b, c = "tiny", "tiny-coder", "tiny-writer"
    t = _Tables()
    seqs = {0: list(ids[a][:n]), 1: list(ids[b][:n]), 2: list(ids[c][:n]), 3: list(ids[b][:n - 2]),
            4: list(ids[c]), 5: list(ids[a][:5])}
    model = {0: a, 1: b, 2: c, 3: b, 4: c, 5: a}
    seen = []
    real = runner.paged_step
    runner.paged_step = lambda *args: seen.append(args[-1]) or real(*args)  # the step's prompts
    with torch.inference_mode():
        out = runner.forward(_step(t, [], [(5, seqs[5], 0, slot[a]), (4, seqs[4][:6], 0, slot[c])]))
        seqs[5].append(int(out[0].argmax()))
        # the step under test: 5 decodes, 4 continues, 0-3 start
        out = runner.forward(_step(t, [(5, seqs[5][-1], len(seqs[5]) - 1, slot[a])],
                                   [(4, seqs[4][6:], 6, slot[c])]
                                   + [(i, seqs[i], 0, slot[model[i]]) for i in range(4)]))
    if backend == "sdpa":
        lengths = {length: (firsts, rows) for length, firsts, rows in seen[-1]}
        assert sorted(lengths) == [n - 2, n] and len(lengths[n][0]) == 3 and lengths[n][1].numel() == 3 * n
        assert lengths[n - 2][1] is None  # one prompt of that length: sliced, not gathered
    else:  # FlexAttention: every chunk, continuing or whole, in one call over the cache
        assert seen[-1] == []
    for row, i in enumerate((5, 4, 0, 1, 2, 3)):
        torch.testing.assert_close(out[row], _alone(eng, model[i], seqs[i])[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend,full", [("sdpa", False), ("flex", False), ("flex", True)],
                         ids=["sdpa-piecewise", "flex-piecewise", "flex-full"])
def test_piecewise_segments_give_the_eager_steps_logits(eng, backend, full):
    """Steps with prefill chunks run as PiecewiseGraphs' segments, attention between them, or as
    FullGraphs' one step of static attention inputs (eagerly here: what the graphs record), the tokens
    padded to a bucket: the logits of the sampled rows equal the eager step's, and each sequence's own
    run alone."""
    from deltafleet.serve.graphs import FullGraphs, PiecewiseGraphs, token_buckets

    assert token_buckets(100) == [16, 32, 64, 100] and token_buckets(16) == [16]
    # doubling up to 256, then quarter steps: a step of n tokens pads to at most 1.25·n from there
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    assert token_buckets(2000)[-3:] == [1536, 1792, 2000]
    runner = ModelRunner(eng.model, eng.slots, n_blocks=32, block_size=BS, max_batch=4, max_seq_len=64,
                         attention=backend)
    pw = (FullGraphs if full else PiecewiseGraphs)(runner, max_tokens=40, max_sample=4, capture=False)
    a, b = eng.encode_prompt(PROMPTS["tiny"] * 2), eng.encode_prompt(PROMPTS["tiny-coder"] * 3)
    t = _Tables()
    with torch.inference_mode():
        # a whole prompt and the first chunk of another: 16-token bucket, two sampling rows
        first = _step(t, [], [(0, a, 0, -1), (1, b[:5], 0, -1)])
        assert pw.bucket(len(first.tokens)) == 16 > len(first.tokens) and pw.accepts(first)
        got = pw.run(first).clone()
        torch.testing.assert_close(got, runner.forward(first), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0], _alone(eng, "tiny", a)[-1], rtol=1e-4, atol=1e-4)
        # a decode row beside the rest of the second prompt
        nxt = int(got[0].argmax())
        second = _step(t, [(0, nxt, len(a), -1)], [(1, b[5:], 5, -1)])
        got = pw.run(second).clone()
        torch.testing.assert_close(got, runner.forward(second), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0], _alone(eng, "tiny", a + [nxt])[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], _alone(eng, "tiny", b)[-1], rtol=1e-4, atol=1e-4)
        # the same step with its decode row's token still on the device: row 1 of the previous step's
        # tokens (asynchronous scheduling), by both paths
        fed = dataclasses.replace(second, tokens=[0] + second.tokens[1:], prev_rows=[1])
        prev = torch.tensor([3, nxt])
        torch.testing.assert_close(pw.run(fed, prev), got, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(runner.forward(fed, prev), got, rtol=1e-5, atol=1e-5)
        # variants: a coder prompt beside a base one, then a coder decode row beside a writer's chunk
        coder, writer = eng.get_delta("tiny-coder").slot, eng.get_delta("tiny-writer").slot
        t = _Tables()
        third = _step(t, [], [(0, b, 0, coder), (1, a[:7], 0, -1)])
        assert pw.accepts(third)
        got = pw.run(third).clone()
        torch.testing.assert_close(got, runner.forward(third), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0], _alone(eng, "tiny-coder", b)[-1], rtol=1e-4, atol=1e-4)
        nxt = int(got[0].argmax())
        w = eng.encode_prompt(PROMPTS["tiny-writer"])
        fourth = _step(t, [(0, nxt, len(b), coder)], [(2, w, 0, writer)])
        got = pw.run(fourth).clone()
        torch.testing.assert_close(got, runner.forward(fourth), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[0], _alone(eng, "tiny-coder", b + [nxt])[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[1], _alone(eng, "tiny-writer", w)[-1], rtol=1e-4, atol=1e-4)
    scored = _step(_Tables(), [], [(0, a, 0, -1)])
    scored.score = [0]
    assert not pw.accepts(scored)  # a step that scores prompt tokens: eager
    with pytest.raises(ValueError, match="1 to 40 tokens"):
        pw.bucket(41)


def test_full_graphs_fix_the_prefill_buffers_at_the_longest_padded_query(eng):
    """FullGraphs records FlexMask's prefill buffers by address: they are sized at once for the
    padded query of the largest step (a 40-token budget pads to 64), so an eager step of 40 tokens
    leaves them where they are, and growing them past that is refused (a graph would go on writing
    freed memory)."""
    from deltafleet.serve.attention import prefill_length
    from deltafleet.serve.graphs import FullGraphs

    runner = ModelRunner(eng.model, eng.slots, n_blocks=32, block_size=BS, max_batch=4, max_seq_len=64,
                         attention="flex")
    FullGraphs(runner, max_tokens=40, max_sample=4, capture=False)
    masks = runner.masks
    assert prefill_length(40) == 64 and masks.seq_q.numel() == 64 and masks.fixed
    where = masks.seq_q.data_ptr(), masks.pos_q.data_ptr()
    ids = (eng.encode_prompt(PROMPTS["tiny"]) * 8)[:40]
    with torch.inference_mode():
        runner.forward(_step(_Tables(), [], [(0, ids, 0, -1)]))
    assert (masks.seq_q.data_ptr(), masks.pos_q.data_ptr()) == where
    with pytest.raises(RuntimeError, match="65 prefill tokens past the 64 that CUDA graphs recorded"):
        masks.reserve(65)


@pytest.mark.parametrize("full", [False, True], ids=["piecewise", "full"])
def test_large_buckets_multiply_prompt_chunks_by_tiles_of_one_variant(eng, monkeypatch, full):
    """Buckets from SEGMENT_MIN_TOKENS on (here 32) multiply a step's rows by tiles of one variant
    each, its decode rows by the base's with their variants' sign products added after
    (``PiecewiseGraphs.segmented``; on a Hopper GPU one kernel, here the tiles one by one): the staged
    tiles are the decode rows' base tile, the chunks' runs, then the padding's zero tile, the decode
    slots the decode rows' variants then the base, and the logits equal the eager step's and each
    sequence's own run."""
    from deltafleet.kernels.reference import ZERO_SLOT, segment_tiles
    from deltafleet.serve import graphs
    from deltafleet.serve.graphs import FullGraphs, PiecewiseGraphs

    monkeypatch.setattr(graphs, "SEGMENT_MIN_TOKENS", 32)
    runner = ModelRunner(eng.model, eng.slots, n_blocks=48, block_size=BS, max_batch=4, max_seq_len=64,
                         attention="flex" if full else "sdpa")
    pw = (FullGraphs if full else PiecewiseGraphs)(runner, max_tokens=64, max_sample=4, capture=False)
    assert not pw.segmented(16) and pw.segmented(32) and pw.segmented(64)
    coder, writer = eng.get_delta("tiny-coder").slot, eng.get_delta("tiny-writer").slot
    a, b = eng.encode_prompt(PROMPTS["tiny"] * 2), eng.encode_prompt(PROMPTS["tiny-coder"] * 3)
    w = eng.encode_prompt(PROMPTS["tiny-writer"] * 2)
    t = _Tables()
    with torch.inference_mode():
        first = _step(t, [], [(0, a, 0, -1), (1, b, 0, coder)])  # sorted by variant, as the scheduler does
        n, bucket = len(first.tokens), pw.bucket(len(first.tokens))
        assert bucket >= 32
        got = pw.run(first).clone()
        # no decode row: the base prompt's tile from row 0, though rows 0-3 are the decode part's
        want_tiles = segment_tiles([(0, len(a), -1), (len(a), n, coder), (n, bucket, ZERO_SLOT)])
        assert pw.tiles[:len(want_tiles)].tolist() == [list(x) for x in want_tiles]
        torch.testing.assert_close(got, runner.forward(first), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], _alone(eng, "tiny-coder", b)[-1], rtol=1e-4, atol=1e-4)
        nxt_a, nxt_b = int(got[0].argmax()), int(got[1].argmax())
        second = _step(t, [(0, nxt_a, len(a), -1), (1, nxt_b, len(b), coder)], [(2, w, 0, writer)])
        n, bucket = len(second.tokens), pw.bucket(len(second.tokens))
        got = pw.run(second).clone()
        # the decode rows (the base's and a coder's) by the base's tile, their sign products after
        want_tiles = segment_tiles([(0, 2, -1), (2, n, writer), (n, bucket, ZERO_SLOT)])
        assert pw.tiles[:len(want_tiles)].tolist() == [list(x) for x in want_tiles]
        assert int((pw.tiles[:, 0] < pw.tiles[:, 1]).sum()) == len(want_tiles)
        assert pw.decode_variants.tolist() == [-1, coder, -1, -1]
        torch.testing.assert_close(got, runner.forward(second), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], _alone(eng, "tiny-coder", b + [nxt_b])[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got[2], _alone(eng, "tiny-writer", w)[-1], rtol=1e-4, atol=1e-4)


def test_graphs_take_tiles_only_where_the_kernel_runs_for_every_linear(eng, monkeypatch):
    """A captured bucket multiplies by tiles only if the tile kernel runs for every linear of a layer
    (a graph cannot read the tile table on the host to take the tiles one by one): asked for each
    matrix's K, and one refusal (here the MLP's down projection) keeps the grouped path."""
    from deltafleet.serve import graphs
    from deltafleet.serve.graphs import PiecewiseGraphs

    monkeypatch.setattr(graphs, "SEGMENT_MIN_TOKENS", 32)
    down_k = eng.model.layers[0].mlp.down_proj.weight.shape[1]
    asked = []

    def supported(x, weight, signs):
        asked.append(x.shape[-1])
        return x.shape[-1] != down_k

    monkeypatch.setattr(graphs, "segments_supported", supported)
    runner = ModelRunner(eng.model, eng.slots, n_blocks=48, block_size=BS, max_batch=4, max_seq_len=64)
    pw = PiecewiseGraphs(runner, max_tokens=64, max_sample=4, capture=True)
    assert not pw.segmented(64) and down_k in asked and eng.model.args.dim in asked
    monkeypatch.setattr(graphs, "segments_supported", lambda x, weight, signs: True)
    assert PiecewiseGraphs(runner, max_tokens=64, max_sample=4, capture=True).segmented(64)


@pytest.mark.parametrize("long_m", [None, 16], ids=["blocks", "long-blocks"])
def test_piecewise_segments_group_the_variants_once_per_step(eng, monkeypatch, long_m):
    """On a GPU a piecewise step of many tokens multiplies grouped by variant
    (``BatchDeltas.grouped``); here under Triton's interpreter with the threshold at two tokens: the
    first segment groups the tokens once (into the bucket's static buffers), every later segment
    reads that grouping (the head groups its sampling rows), and the logits equal the eager step's.
    With ``long_m`` the prompt chunk's run leads with whole long blocks (Hopper's grouping of prompt
    chunks), kept in static buffers of their own."""
    pytest.importorskip("triton")
    from deltafleet.serve.graphs import PiecewiseGraphs
    from tests.conftest import record_groupings

    runner = ModelRunner(eng.model, eng.slots, n_blocks=32, block_size=BS, max_batch=4, max_seq_len=64)
    pw = PiecewiseGraphs(runner, max_tokens=40, max_sample=4, capture=False)
    coder, writer = eng.get_delta("tiny-coder").slot, eng.get_delta("tiny-writer").slot
    a, b = eng.encode_prompt(PROMPTS["tiny"]), eng.encode_prompt(PROMPTS["tiny-coder"] * 2)
    w = eng.encode_prompt(PROMPTS["tiny-writer"])
    step = _step(_Tables(), [], [(0, b, 0, coder), (1, a, 0, -1), (2, w, 0, writer)])
    with torch.inference_mode():
        want = runner.forward(step).float()
        groupings = record_groupings(monkeypatch, long_m)
        got = pw.run(step).float()
    n = len(step.tokens)
    static = pw.groups[pw.bucket(n)]
    if long_m:  # the coder prompt's leading 16 rows make the one live long block
        assert int((static.long.first < pw.bucket(n)).sum()) == len(b) // long_m == 1
    else:
        assert static.long is None
    # the bucket's tokens once (padding tokens on the base), then the head's sampling rows (padded
    # to max_sample with token 0)
    heads = [step.variants[i] for i in step.sample] + [step.variants[0]] * (pw.max_sample - len(step.sample))
    assert groupings == [step.variants + [-1] * (pw.bucket(n) - n), heads]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
