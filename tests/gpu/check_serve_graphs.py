"""GPU check of serve/graphs.py: continuous-batching decode steps replayed as CUDA graphs vs eager.

    python3 tests/gpu/check_serve_graphs.py OUT.json

Builds a tiny random Llama family in a temporary folder (the tests' BPE tokenizer, a base of width
256, 4 layers, 8 heads / 4 kv heads, and three BitDelta variants: coder, writer — which also
changes norms — and math), loads it on CUDA in bfloat16, then:

1. Correctness: mixed batches of 1, 3 and 5 rows (base and variants, different positions, in
   scattered cache rows) and a base-only batch of 2, prefilled identically into two copies of one
   KV cache (16 sequence rows + the scratch row). Each batch runs 4 decode steps eagerly
   (``forward_rows``, the scheduler's eager path) on one copy and by graph replay
   (``DecodeGraphs.run``) on the other, both fed the eager step's greedy tokens; the 4th step
   changes the rows' variants (the captured graph must read the static slot tensor written in
   place). Pass: for every step, max |graph − eager| over the real rows' logits ≤ 0.02·max(1,
   max |eager|) (bf16 rounding through 4 layers; the two paths run the same kernels on the same
   M bucket, so they differ only by the split-K kernels' atomic summation order); after all
   batches the 16 sequence rows of the two caches agree within the same relative bound, and the
   eager cache's scratch row is untouched.
2. Timing: one decode step of B = 1, 3, 8, 16 rows (variants mixed; 3 runs padded to 4), eager
   vs graph replay, wall time per step over 100 steps after warm-up, synchronised (host launch
   overhead is what graphs remove, so host time counts).
3. The engine end to end, ``Engine(..., cuda_graphs=True)`` and ``False``: five greedy requests
   (base + the three variants) decoded together. Pass: with graphs on, every decode step was a
   graph replay, and at least 3 of 5 completions equal the eager engine's token for token (a
   bf16 near-tie can legitimately flip a greedy choice, after which a sequence diverges; the
   logits check of part 1 is the strict one).

Prints and writes a JSON summary to OUT.json. Exit status: 0 pass, 1 a mismatch, 0 with a message
(and ``"skipped"`` in the JSON) when there is no CUDA device.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
# tests/conftest.py chooses Triton's CPU interpreter unless told the Triton tests run on a GPU.
os.environ.setdefault("DELTAFLEET_TRITON_DEVICE", "cuda")
os.environ.setdefault("DELTAFLEET_TRITON_AUTOTUNE", "0")  # default tiles: no minutes of tuning per row count

VARIANTS = ("coder", "writer", "math")
SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256)
MAX_BATCH, SEQ = 16, 128
DEVICE = "cuda"
REL_TOL = 0.02


def build_family(root: Path) -> tuple[Path, Path]:
    """Tokenizer + base + variants + their BitDelta artifacts, as tests/conftest.py builds them."""
    from deltafleet.compress.bitdelta import compress
    from tests.conftest import perturb, tiny_llama, train_tiny_tokenizer

    base_dir, arts = root / "models" / "base", root / "artifacts"
    tok = train_tiny_tokenizer(base_dir, root / "data")
    kw = dict(SHAPE, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    base = tiny_llama(len(tok), seed=0, **kw)
    base.save_pretrained(base_dir)
    norms = {"writer": ("model.norm.weight", "model.layers.1.input_layernorm.weight")}
    for i, v in enumerate(VARIANTS):
        ft = tiny_llama(len(tok), seed=0, **kw)
        ft.load_state_dict(perturb(base, seed=100 + i, norms=norms.get(v, ())))
        ft.save_pretrained(root / "models" / v)
        compress(base_dir, root / "models" / v, arts / v, variant=v)
    return base_dir, arts


def _diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got − want|, the bound it must stay under)."""
    return float((got.float() - want.float()).abs().max()), REL_TOL * max(1.0, float(want.float().abs().max()))


def check_logits(model, slots, views: dict) -> tuple[list[dict], dict, object]:
    """Part 1 (module docstring): per-batch results, the caches' comparison, the DecodeGraphs."""
    from deltafleet.serve.batch import BatchDeltas, RowCache
    from deltafleet.serve.graphs import DecodeGraphs

    eager_cache = model.new_cache(MAX_BATCH + 1, SEQ)
    graphs = DecodeGraphs(model, slots, model.new_cache(MAX_BATCH + 1, SEQ))
    dev, vocab = model.device, model.args.vocab_size
    gen = torch.Generator().manual_seed(0)
    order = [-1] + [views[v].slot for v in VARIANTS]  # base → coder → writer → math → base
    cases = [(["coder"], [7]), (["base", "coder", "writer"], [0, 9, 4]),
             (["base", "coder", "writer", "math", "coder"], [1, 3, 15, 6, 11]), (["base", "base"], [2, 12])]
    results = []
    for models, rows in cases:
        slot_list = [-1 if m == "base" else views[m].slot for m in models]
        tokens, pos = [], []
        with torch.inference_mode():
            for i, (m, r) in enumerate(zip(models, rows)):  # prefill each row, identically in both caches
                prompt = torch.randint(1, vocab, (1, 3 + 2 * i), generator=gen).to(dev)
                for cache in (eager_cache, graphs.cache):
                    view = [RowCache(c, torch.tensor([r], device=dev), per_row_positions=False) for c in cache]
                    logits = model(prompt, torch.arange(prompt.shape[1], device=dev), view,
                                   None if m == "base" else views[m])[0, -1]
                tokens.append(int(logits.argmax()))
                pos.append(prompt.shape[1])
            worst = []
            for step in range(4):
                if step == 3 and any(s >= 0 for s in slot_list):  # other variants, the same captured graph
                    slot_list = [order[(order.index(s) + 1) % len(order)] for s in slot_list]
                with_deltas = any(s >= 0 for s in slot_list)
                delta = BatchDeltas(slots, torch.tensor(slot_list, device=dev)) if with_deltas else None
                want = model.forward_rows(torch.tensor(tokens, device=dev), torch.tensor(pos, device=dev),
                                          eager_cache, torch.tensor(rows, device=dev), delta)
                got = graphs.run(tokens, pos, rows, slot_list).clone()
                worst.append(_diff(got, want))
                tokens, pos = want.argmax(-1).tolist(), [p + 1 for p in pos]
        torch.cuda.synchronize()
        err, bound = max(worst, key=lambda d: d[0] / d[1])
        results.append({"rows": len(rows), "bucket": graphs.bucket(len(rows)), "models": models,
                        "max_abs_diff": err, "bound": bound, "ok": err <= bound})
    cache_err = {"k": 0.0, "v": 0.0}
    ok = True
    for e, g in zip(eager_cache, graphs.cache):
        for name in ("k", "v"):
            a, b = getattr(e, name), getattr(g, name)
            d, bound = _diff(b[:MAX_BATCH], a[:MAX_BATCH])  # the sequence rows; the last is the scratch row
            cache_err[name] = max(cache_err[name], d)
            ok &= d <= bound and not a[MAX_BATCH].any()
    return results, {"max_abs_diff": cache_err, "ok": ok}, graphs


def time_steps(model, graphs, views: dict, n_steps: int = 100) -> list[dict]:
    """Part 2: ms per decode step, eager and by replay, at B = 1, 3, 8, 16 (variants mixed)."""
    from deltafleet.serve.batch import BatchDeltas

    dev = model.device
    order = [-1] + [views[v].slot for v in VARIANTS]
    out = []
    for b in (1, 3, 8, 16):
        tokens, pos, rows = [5] * b, [32] * b, list(range(b))
        slot_list = [order[i % len(order)] for i in range(b)]

        def eager():
            delta = BatchDeltas(graphs.slots, torch.tensor(slot_list, device=dev))
            return graphs.model.forward_rows(torch.tensor(tokens, device=dev), torch.tensor(pos, device=dev),
                                             graphs.cache, torch.tensor(rows, device=dev), delta)

        def replay():
            return graphs.run(tokens, pos, rows, slot_list)

        row = {"batch": b, "bucket": graphs.bucket(b)}
        with torch.inference_mode():
            for name, fn in (("eager_ms", eager), ("graph_ms", replay)):
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(n_steps):
                    fn()
                torch.cuda.synchronize()
                row[name] = (time.perf_counter() - t0) / n_steps * 1e3
        row["speedup"] = row["eager_ms"] / row["graph_ms"]
        out.append(row)
        print(f"  B={b:2d}: eager {row['eager_ms']:.3f} ms, graph {row['graph_ms']:.3f} ms, ×{row['speedup']:.2f}")
    return out


def check_engine(base_dir: Path, arts: Path) -> dict:
    """Part 3: five greedy requests decoded together by the engine, graphs on and off."""
    from deltafleet.serve.engine import Engine, SamplingParams

    jobs = ["tiny", "tiny-coder", "tiny-writer", "tiny-math", "tiny-coder"]
    prompts = ["def main(", "import os\nimport", "The quick brown", "x = 1 +", "class A:"]
    got, replays = {}, None
    for flag in (True, False):
        engine = Engine(base_dir, arts, family="tiny", device=DEVICE, dtype="bfloat16", max_batch=8,
                        cuda_graphs=flag)
        results = [None] * len(jobs)

        def go(i):
            results[i] = engine.complete(jobs[i], prompts[i], SamplingParams(max_tokens=16, temperature=0)).token_ids

        with engine._gen_lock:  # every request enters the batch together
            threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
            for t in threads:
                t.start()
            deadline = time.time() + 120
            while sum(engine.scheduler.waiting().values()) < len(jobs) and time.time() < deadline:
                time.sleep(0.01)
        for t in threads:
            t.join(300)
        got[flag] = results
        if flag:
            sch = engine.scheduler
            replays = {"graphs": sch.graphs is not None, "replays": sch.graphs.replays if sch.graphs else 0,
                       "steps": sch.steps, "max_rows": sch.max_rows_seen,
                       "captured": sorted(map(list, sch.graphs.graphs)) if sch.graphs else []}
    same = sum(a == b for a, b in zip(got[True], got[False]))
    ok = bool(replays["graphs"]) and replays["replays"] == replays["steps"] > 0 and same >= 3
    return {**replays, "completions_equal": same, "of": len(jobs), "ok": ok}


def main(out_path: str) -> int:
    summary: dict = {"script": "tests/gpu/check_serve_graphs.py", "date": time.strftime("%Y-%m-%d %H:%M")}
    if not torch.cuda.is_available():
        print("check_serve_graphs: no CUDA device, skipped")
        summary["skipped"] = "no CUDA device"
        Path(out_path).write_text(json.dumps(summary, indent=2))
        return 0
    from deltafleet import kernels
    from deltafleet.compress.bitdelta import load_artifact
    from deltafleet.serve.batch import DeltaSlots
    from deltafleet.serve.model import Transformer, VariantDelta

    summary.update(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=SHAPE,
                   max_batch=MAX_BATCH, dtype="bfloat16", rel_tol=REL_TOL)
    if not kernels._ops():
        print("check_serve_graphs: triton is not installed: batches with variants cannot be captured")
        summary["error"] = "no triton"
        Path(out_path).write_text(json.dumps(summary, indent=2))
        return 1
    import triton

    summary["triton"] = triton.__version__
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        base_dir, arts = build_family(Path(tmp))
        summary["build_s"] = time.perf_counter() - t0
        model = Transformer.from_pretrained(base_dir, DEVICE, torch.bfloat16)
        slots = DeltaSlots(model, len(VARIANTS))
        views = {v: slots.put(VariantDelta(load_artifact(arts / v), DEVICE, torch.bfloat16)) for v in VARIANTS}
        print("correctness (graph vs eager logits, per batch):")
        cases, cache, graphs = check_logits(model, slots, views)
        for c in cases:
            print(f"  {c['rows']} rows (bucket {c['bucket']}) {c['models']}: max |Δ| {c['max_abs_diff']:.3g} "
                  f"≤ {c['bound']:.3g}: {'ok' if c['ok'] else 'MISMATCH'}")
        print(f"  KV caches: max |Δ| {cache['max_abs_diff']}: {'ok' if cache['ok'] else 'MISMATCH'}")
        print("timing (one decode step, wall time):")
        summary.update(cases=cases, cache=cache, timing=time_steps(model, graphs, views),
                       captured=sorted(map(list, graphs.graphs)))
        del graphs, model, slots, views
        torch.cuda.empty_cache()
        print("engine (cuda_graphs on vs off):")
        summary["engine"] = check_engine(base_dir, arts)
        print(f"  {summary['engine']}")
    summary["ok"] = all(c["ok"] for c in cases) and cache["ok"] and summary["engine"]["ok"]
    Path(out_path).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 tests/gpu/check_serve_graphs.py OUT.json")
    sys.exit(main(sys.argv[1]))
