"""DeepSpeed ZeRO-2/3 on CPU (gloo): the callback's one-parameter read/write helpers, per rank.

    RANK=r WORLD_SIZE=2 LOCAL_RANK=r MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/scripts/deepspeed_params.py OUT

Launched by tests/test_callback.py (skipped where deepspeed is not installed). For ZeRO stages 2
and 3 it checks, on every rank, that ``read_full_param`` returns the full fp32 weights, that
``write_full_param`` changes both the model weights and the optimizer's fp32 master copy (an optimizer
step with lr 0 afterwards keeps the new values instead of restoring the old ones), and writes
``OUT/ds_rank<r>.json`` with the outcome.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


import deepspeed  # noqa: E402

from deltafleet.train.distributed import read_full_param as _read_full, write_full_param as _write_full  # noqa: E402


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # odd sizes: ZeRO pads the partitions
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def check(stage: int) -> dict:
    m = model()
    initial = {n: p.detach().clone() for n, p in m.named_parameters()}
    engine, *_ = deepspeed.initialize(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=0.0), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True})
    rank0 = torch.distributed.get_rank() == 0
    read_ok = all(torch.equal(_read_full(p, deepspeed).cpu(), initial[n]) for n, p in m.named_parameters())
    new = {n: 2.0 * t + 1.0 for n, t in initial.items()}
    for n, p in m.named_parameters():
        _write_full(p, new[n].to(p.device), deepspeed, rank0)
    master_ok = all(torch.equal(_read_full(p, deepspeed).cpu(), new[n]) for n, p in m.named_parameters())
    # an optimizer step (lr 0) copies the fp32 master back into the model weights
    x = torch.randn(2, 5)
    loss = engine(x).sum()
    engine.backward(loss)
    engine.step()
    with deepspeed.zero.GatheredParameters(list(m.parameters()), enabled=stage == 3):
        model_ok = all(torch.equal(p.detach().cpu().float(), new[n]) for n, p in m.named_parameters())
    return {"read": read_ok, "master": master_ok, "model_after_step": model_ok}


if __name__ == "__main__":
    # ZeRO's collectives go through torch.distributed (gloo here): DeepSpeed's shared-memory comm op
    # serves only its inference all-reduce, and building it is a C++ compile of about 45 CPU-seconds
    # on a fresh machine, so it is not built
    import importlib

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # deepspeed.comm.torch is torch
    deepspeed.init_distributed(dist_backend="gloo")
    out = {f"zero{s}": check(s) for s in (2, 3)}
    Path(sys.argv[1], f"ds_rank{os.environ['RANK']}.json").write_text(json.dumps(out))
    # leave together and tear the process group down before exit: a rank that exits while DeepSpeed's
    # CPU comm threads still run dies in std::terminate ("terminate called without an active
    # exception", seen once in a CI run), which fails the test after its results were written
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # and still seen once after that (a DeepSpeed thread destroyed at interpreter exit): the results are
    # written and the group is gone, so leave without running the interpreter's finalisation
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
