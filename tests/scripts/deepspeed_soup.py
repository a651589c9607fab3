"""MonoSoupCallback under Lightning + DeepSpeed ZeRO-2/3 on 2 CUDA GPUs (not part of the CPU suite).

    python tests/scripts/deepspeed_soup.py OUT_DIR STAGE [METHOD]     # STAGE: 2 or 3

Lightning runs DeepSpeed on CUDA only, so this is run by hand on a GPU machine. bf16-mixed, tiny
Llama, merge at step 3. At the merge step every rank records the full fp32 master weights before
and after the merge (the callback's own gather helper) and the bf16 model weights after it
(``GatheredParameters`` under ZeRO-3); rank 0 adds the base and best snapshots. Then it checks:
both ranks hold the same merged weights, the fp32 masters equal ``merge_param`` recomputed on the
CPU from the same inputs, and the bf16 model weights equal the masters rounded to bf16.
Prints ``DEEPSPEED_SOUP OK`` and writes ``OUT_DIR/zero<STAGE>_rank<r>.pt``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soup_fixtures import BlocksDataModule, tiny_llama  # noqa: E402
from deltafleet.merge.soup import merge_param  # noqa: E402
from deltafleet.train.callbacks import MonoSoupCallback  # noqa: E402
from deltafleet.train.distributed import read_full_param as _read_full  # noqa: E402
from deltafleet.train.module import CausalLMModule  # noqa: E402

MERGE_STEP = 3


class Dump(L.Callback):
    def __init__(self, soup: MonoSoupCallback, key: str, out: dict):
        self.soup, self.key, self.out = soup, key, out

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step != MERGE_STEP or self.key in self.out:
            return
        import deepspeed

        self.out[self.key] = {n: _read_full(p, deepspeed).cpu().clone() for n, p in pl_module.named_parameters()}
        if self.key == "post":
            lp = {}
            for n, p in pl_module.named_parameters():
                with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                    lp[n] = p.detach().cpu().clone()
            self.out["post_model"] = lp
        if self.key == "pre" and trainer.is_global_zero:
            self.out["best"] = {n: t.clone() for n, t in self.soup.best.items()}
            self.out["base"] = {n: t.clone() for n, t in self.soup.base.items()}


def main(out_dir: Path, stage: int, method: str) -> None:
    L.seed_everything(0)
    module = CausalLMModule(tiny_llama(), lr=1e-2, weight_decay=0.0, warmup_steps=1, max_steps=MERGE_STEP)
    soup = MonoSoupCallback(method=method, every_n_steps=MERGE_STEP, val_batches=2)
    out: dict = {}
    trainer = L.Trainer(accelerator="gpu", devices=2, strategy=f"deepspeed_stage_{stage}", precision="bf16-mixed",
                        max_steps=MERGE_STEP, val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=2,
                        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Dump(soup, "pre", out), soup, Dump(soup, "post", out)],
                        default_root_dir=str(out_dir))
    trainer.fit(module, datamodule=BlocksDataModule())
    out["records"] = soup.records
    rank = trainer.global_rank
    torch.save(out, out_dir / f"zero{stage}_rank{rank}.pt")
    torch.distributed.barrier()
    if rank != 0:
        return
    other = torch.load(out_dir / f"zero{stage}_rank1.pt", weights_only=False)
    assert [r["step"] for r in out["records"]] == [MERGE_STEP], out["records"]
    worst = 0.0
    for n, merged in out["post"].items():
        assert torch.equal(merged, other["post"][n]), f"ranks differ on {n}"
        assert torch.equal(out["post_model"][n], other["post_model"][n]), f"ranks' model weights differ on {n}"
        ref, _ = merge_param(method, out["base"][n], [out["pre"][n], out["best"][n]])
        worst = max(worst, (merged - ref).abs().max().item())
        torch.testing.assert_close(merged, ref, atol=1e-5, rtol=1e-4, msg=n)
        assert torch.equal(out["post_model"][n].float(), merged.to(out["post_model"][n].dtype).float()), n
    assert any(not torch.equal(out["post"][n], out["pre"][n]) for n in out["pre"])
    print(f"DEEPSPEED_SOUP OK zero{stage} {method}: {len(out['post'])} params, max |merged - ref| = {worst:.2e}, "
          f"record {out['records'][0]}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "monosoup")
