"""The engine's decode step against the memory-bandwidth floor, without HTTP (part of ``make
bench-serve``; alone: ``python -m deltafleet.serve.bench_step``).

A synthetic family (serve/synthetic.py: the base and ``variants`` BitDelta variants generated on the
device) is put in one :class:`~deltafleet.serve.runner.ModelRunner` as the server holds it (variant
slots, paged KV cache, CUDA graphs, FlexAttention). For each row count ``R`` and each mix — ``base``
(every row on the base) and ``mixed`` (row ``i`` on variant ``i mod variants``) — a decode step of
``R`` rows, each at position ``context`` (its keys and values in ``ceil((context + 1) / block_size)``
scattered blocks), is run as the scheduler runs it (``ModelRunner.execute``: padding to the graph's
bucket, the host-to-device copy of the inputs, the replay) and timed over ``iters`` steps after a
warm-up, as is the sampling of its logits (serve/sampling.py).

The floor is the bytes a step cannot avoid reading — every weight matrix the step multiplies by and
the norms, each distinct variant's signs and scales, and the rows' live keys and values — divided by
the device's copy bandwidth, timed in the same run (a 2 GiB device-to-device copy: bytes read +
bytes written over its time). ``step_over_floor`` = step time ÷ floor.

Each row also times two eager steps (``ModelRunner.forward``, no CUDA graph): the same decode rows
(``eager_ms``), and the decode rows plus one prompt of the mix's first model, of the first length in
``prompts`` (``with_prompt_ms``). ``eager_ms`` − ``step_ms`` is what running a step from Python rather
than from a graph costs. ``with_prompt_step_ms`` maps each length in ``prompts`` to the step of the
decode rows plus one prompt of that length as ``ModelRunner.execute`` runs it, by CUDA graphs of steps
with prefill chunks (serve/graphs.py: the step padded to its token bucket, its prompt multiplied
grouped or by tiles); the runner holds one sequence more than the largest row count, the prompt's,
as a server's ``max_batch`` counts prefilling sequences too.

With ``profile`` (``--profile STEPS``) each row also profiles that many steps (``torch.profiler``) and
keeps where their GPU time goes (:func:`kernel_table`): the kernel time a step and the longest
kernels, each with its time and launches a step.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

SHAPE_7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32}
DEFAULTS = {"rows": [1, 16, 64, 256], "context": 256, "iters": 20, "block_size": 128, "variants": 14, "prompts": [256],
            "profile": 0}
PROFILE_TOP = 15  # kernels listed per row by ``profile``


def _seconds(fn, iters: int, device, warmup: int = 1) -> float:
    """Seconds per call of ``fn`` launched ``iters`` times back to back, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t) / iters


def kernel_table(kernels, steps: int, top: int = PROFILE_TOP) -> dict:
    """Where a step's GPU time goes: ``kernels`` the (name, microseconds) of every kernel run over
    ``steps`` steps; returns ``{"kernel_ms": kernel time a step, "kernels": [{"name", "ms", "calls"},
    …]}``, each kernel's time and launches a step, the ``top`` longest first (names cut at 120
    characters; kernels whose cut names agree are one). Kernel time over the step's time is how much
    the kernels overlap (above 1) or leave the GPU idle (below 1)."""
    agg: dict[str, list] = {}
    for name, us in kernels:
        a = agg.setdefault(name[:120], [0.0, 0])
        a[0] += us
        a[1] += 1
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernel_ms": sum(a[0] for a in agg.values()) / steps / 1e3,
            "kernels": [{"name": n, "ms": t / steps / 1e3, "calls": c / steps} for n, (t, c) in rows]}


def profile_kernels(fn, steps: int, device: torch.device) -> dict:
    """:func:`kernel_table` of ``steps`` calls of ``fn`` under ``torch.profiler`` (CUDA kernels, and the
    copies and fills the profiler counts with them)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize(device)
    return kernel_table(((e.name, e.device_time_total) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA), steps)


def copy_bandwidth(device: torch.device, n_bytes: int = 2 << 30, iters: int = 10) -> float:
    """Bytes per second of a device-to-device copy of ``n_bytes`` (read + write, as the floor counts reads)."""
    x = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * n_bytes / _seconds(lambda: y.copy_(x), iters, device, warmup=2)


def step_bytes(model, slots, rows: int, distinct_variants: int, context: int) -> dict:
    """The bytes a decode step of ``rows`` rows at position ``context`` must read (see the module docstring)."""
    from deltafleet.serve.model import DeltaLinear

    linears = {id(m.weight): m for m in model.modules() if isinstance(m, DeltaLinear)}  # a tied head once
    weights = sum(m.weight.numel() * m.weight.element_size() for m in linears.values())
    weights += sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 1)
    per_variant = sum(slots.signs[f"{m.name}.weight"][0].numel() + 4 * slots.alphas[f"{m.name}.weight"].shape[1]
                      + (4 * m.weight.shape[1] if slots.betas else 0) for m in linears.values())
    attn = model.layers[0].self_attn
    kv = 2 * len(model.layers) * attn.n_kv * attn.head_dim * model.dtype.itemsize * rows * (context + 1)
    return {"weights": weights, "signs": distinct_variants * per_variant, "kv": kv,
            "total": weights + distinct_variants * per_variant + kv}


def decode_bytes(shape: dict, itemsize: int, sign_layout: str = "tiled", col_scales: bool = False) -> dict:
    """What :func:`step_bytes` counts, from a Hugging Face config's fields alone (nothing built):
    ``weights`` (every matrix a decode step multiplies by, the head included, and the 1-D
    parameters), ``signs`` (one variant's packed signs in ``sign_layout`` and its scales: α per output
    row, β per input column with ``col_scales``) and ``kv_per_token`` (one cached token's keys and
    values over all layers), in bytes."""
    from deltafleet.serve.model import ModelArgs
    from deltafleet.serve.synthetic import sign_bytes

    a = ModelArgs.from_hf_config(shape)
    q, kv, d, f = a.n_head * a.head_dim, a.n_local_heads * a.head_dim, a.dim, a.intermediate_size
    layer = [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)]
    # (N, K, signs tiled): a tied head is the embedding, whose signs stay rows in every layout
    mats = [(n, k, sign_layout == "tiled") for n, k in layer] * a.n_layer
    mats.append((a.vocab_size, d, sign_layout == "tiled" and not a.tie_word_embeddings))

    biases = (2 * kv + q) * a.qkv_bias + d * a.o_bias + (2 * f + d) * a.mlp_bias
    vectors = (2 * a.n_layer + 1) * d + a.n_layer * biases  # the norms and the biases
    return {"weights": (sum(n * k for n, k, _ in mats) + vectors) * itemsize,
            "signs": sum(sign_bytes(n, k, t) + 4 * n + 4 * k * col_scales for n, k, t in mats),
            "kv_per_token": 2 * a.n_layer * kv * itemsize}


def _with_prompt(step, prompt: int, table: list[int], bs: int, gen: torch.Generator, vocab: int):
    """``step``'s decode rows and one ``prompt``-token prompt (positions 0 …) of its first row's model
    in ``table``'s blocks, every row and the prompt's last token sampling."""
    from deltafleet.serve.runner import StepInput

    r = step.n_decode
    return StepInput(tokens=step.tokens + torch.randint(1, vocab, (prompt,), generator=gen).tolist(),
                     positions=step.positions + list(range(prompt)),
                     kv_slots=step.kv_slots + [table[p // bs] * bs + p % bs for p in range(prompt)],
                     variants=step.variants + [step.variants[0]] * prompt, n_decode=r, tables=step.tables,
                     chunks=[(r, prompt, 0, table)], sample=list(range(r)) + [r + prompt - 1])


def engine_steps(cfg) -> dict:
    """Run the measurement. ``cfg``: a mapping (conf/bench_serve.yaml's): ``shapes[shape]`` (HF config
    fields; default the Llama-2-7B shape), ``device``, ``dtype``, ``variants``, and
    ``engine_steps_options`` (overrides of :data:`DEFAULTS`). Returns ``{"step_over_floor": {"<R>": {"base", "mixed"}}, "rows":
    [...], "copy_GBps", ...}``.

    Raises:
        RuntimeError: without a CUDA device (the floor is a GPU's).
    """
    from deltafleet.serve.batch import DeltaSlots
    from deltafleet.serve.runner import ModelRunner, StepInput
    from deltafleet.serve.sampling import SamplingBatch, sample
    from deltafleet.serve.synthetic import SyntheticFamily

    get = cfg.get
    opts = {**DEFAULTS, **dict(get("engine_steps_options", None) or {})}
    opts["rows"] = list(opts["rows"])
    device = torch.device(get("device", "cuda"))
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError("the engine-step benchmark needs a CUDA device (the floor is a GPU's bandwidth)")
    dtype = getattr(torch, get("dtype", "bfloat16"))
    shapes, name = get("shapes", None), get("shape", None)
    shape = dict(get("shape_config", None) or (shapes[name] if shapes and name else SHAPE_7B))
    opts["variants"] = int(get("variants", opts["variants"]))
    context, bs, n_var = int(opts["context"]), int(opts["block_size"]), int(opts["variants"])
    rows_list = [int(r) for r in opts["rows"]]
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings", 0), context + 2)
    family = SyntheticFamily(shape, variants=n_var)
    model = family.build_base(device, dtype)
    slots = DeltaSlots(model, n_var)
    views = [slots.put(family.variant(name, device)) for name in family.names]
    per_row = math.ceil((context + 1) / bs)
    max_rows = max(rows_list)
    if "prompt" in opts:
        raise ValueError("engine_steps_options.prompt is now prompts, a list of prompt lengths")
    prompts = [int(p) for p in (opts["prompts"] if isinstance(opts["prompts"], (list, tuple)) else [opts["prompts"]])]
    if not prompts or min(prompts) < 1:
        raise ValueError(f"prompts must be one or more lengths ≥ 1, got {prompts}")
    n_blocks = per_row * max_rows + math.ceil(max(prompts) / bs)
    # max_rows decode rows and the prompt's sequence: a step samples max_rows + 1 rows (a runner's
    # graphs of steps with prefill chunks take at most max_batch sampling rows, else the step runs eagerly)
    runner = ModelRunner(model, slots, n_blocks, bs, max_rows + 1, context + 2, cuda_graphs=True,
                         attention="flex", prefill_graphs=max_rows + max(prompts))
    bw = copy_bandwidth(device)
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randperm(n_blocks, generator=gen).tolist()  # scattered, as a busy pool hands them out
    tables = [blocks[i * per_row:(i + 1) * per_row] for i in range(max_rows)]
    prompt_table = blocks[per_row * max_rows:]  # the prompt's own blocks
    out: dict = {"shape": shape, "dtype": str(dtype), "context": context, "block_size": bs, "variants": n_var,
                 "copy_GBps": bw / 1e9, "device": torch.cuda.get_device_name(device), "rows": [],
                 "step_over_floor": {}}
    for r in rows_list:
        for mix in ("base", "mixed"):
            variants = [-1] * r if mix == "base" else [views[i % n_var].slot for i in range(r)]
            step = StepInput(tokens=torch.randint(1, shape["vocab_size"], (r,), generator=gen).tolist(),
                             positions=[context] * r,
                             kv_slots=[tables[i][context // bs] * bs + context % bs for i in range(r)],
                             variants=variants, n_decode=r, tables=tables[:r], sample=list(range(r)))
            with torch.inference_mode():
                # three warm-up steps: the first captures (FlexAttention and the kernels compile)
                step_s = _seconds(lambda: runner.execute(step), opts["iters"], device, warmup=3)
                with_prompt = {p: _with_prompt(step, p, prompt_table, bs, gen, shape["vocab_size"]) for p in prompts}
                eager = {name: _seconds(lambda st=st: runner.forward(st), opts["iters"], device) * 1e3
                         for name, st in (("eager_ms", step), ("with_prompt_ms", with_prompt[prompts[0]]))}
                # as the scheduler runs them: graphs of steps with prefill chunks, one per token bucket
                eager["with_prompt_step_ms"] = {str(p): _seconds(lambda st=st: runner.execute(st), opts["iters"], device,
                                                                 warmup=2) * 1e3 for p, st in with_prompt.items()}
                logits = runner.execute(step)
                # a step's sampling as the scheduler does it: the batch built, sampled, read back
                sampling = {name: _seconds(lambda p=params: sample(logits, SamplingBatch.build(
                    [(*p, i, context + 1) for i in range(r)], device)).tolist(), opts["iters"], device) * 1e3
                    for name, params in (("greedy", (0.0, 1.0, 0)), ("top_p", (0.8, 0.95, 0)))}
            nbytes = step_bytes(model, slots, r, len({v for v in variants if v >= 0}), context)
            floor_s = nbytes["total"] / bw
            row = {"rows": r, "mix": mix, "step_ms": step_s * 1e3, "floor_ms": floor_s * 1e3,
                   "step_over_floor": step_s / floor_s, **eager, "bytes": nbytes, "sample_ms": sampling,
                   "graph": runner.graphs is not None}
            if opts["profile"]:
                with torch.inference_mode():
                    row["profile"] = profile_kernels(lambda: runner.execute(step), int(opts["profile"]), device)
            out["rows"].append(row)
            out["step_over_floor"].setdefault(str(r), {})[mix] = row["step_over_floor"]
            print(json.dumps({k: v for k, v in row.items() if k not in ("bytes", "profile")}), flush=True)
            for k in row.get("profile", {}).get("kernels", []):
                print(f"  {k['ms']:8.3f} ms {k['calls']:6.0f}x  {k['name']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=DEFAULTS["rows"])
    p.add_argument("--context", type=int, default=DEFAULTS["context"])
    p.add_argument("--iters", type=int, default=DEFAULTS["iters"])
    p.add_argument("--variants", type=int, default=DEFAULTS["variants"])
    p.add_argument("--prompts", type=int, nargs="+", default=DEFAULTS["prompts"],
                   help="prompt lengths of the steps timed beside the decode rows (with_prompt_step_ms)")
    p.add_argument("--profile", type=int, default=DEFAULTS["profile"], metavar="STEPS",
                   help="profile STEPS steps of each row (torch.profiler): each kernel's time a step, "
                        f"the {PROFILE_TOP} longest, in the JSON and printed; 0 (the default) for none")
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args(argv)
    for name, values in (("--rows", a.rows), ("--prompts", a.prompts), ("--iters", [a.iters]),
                         ("--variants", [a.variants])):
        if min(values) < 1:
            p.error(f"{name} must be ≥ 1, got {values if len(values) > 1 else values[0]}")
    if a.profile < 0:
        p.error(f"--profile must be ≥ 0, got {a.profile}")
    if a.context < 0:  # the rows' position: 0 is a first decode token after a one-token prompt
        p.error(f"--context must be ≥ 0, got {a.context}")
    if not torch.cuda.is_available():
        p.exit(2, "error: the engine-step benchmark needs a CUDA device (the floor is a GPU's bandwidth)\n")
    res = engine_steps({"engine_steps_options": {"rows": a.rows, "context": a.context, "iters": a.iters,
                                                 "variants": a.variants, "prompts": a.prompts,
                                                 "profile": a.profile}})
    print(json.dumps(res["step_over_floor"], indent=1))
    if a.out:
        from deltafleet.atomic import write_text

        write_text(a.out, json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
