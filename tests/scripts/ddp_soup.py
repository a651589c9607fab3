"""2-process DDP (gloo, CPU) run of MonoSoupCallback, launched by tests/test_callback.py.

    python tests/scripts/ddp_soup.py OUT_DIR [METHOD]

Lightning's DDP launcher re-executes this script once per extra rank. Every rank writes
``OUT_DIR/rank<r>.pt`` with the weights just before and just after the merge at step 3; rank 0
adds the callback's base and best snapshots, so the test can recompute the merge in one process.
"""
from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soup_fixtures import BlocksDataModule, tiny_llama  # noqa: E402
from deltafleet.train.callbacks import MonoSoupCallback  # noqa: E402
from deltafleet.train.module import CausalLMModule  # noqa: E402

MERGE_STEP = 3


class Dump(L.Callback):
    def __init__(self, soup: MonoSoupCallback, key: str, out: dict):
        self.soup, self.key, self.out = soup, key, out

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step != MERGE_STEP or self.key in self.out:
            return
        self.out[self.key] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
        if self.key == "pre" and trainer.is_global_zero:
            self.out["best"] = {n: t.clone() for n, t in self.soup.best.items()}
            self.out["base"] = {n: t.clone() for n, t in self.soup.base.items()}
            self.out["best_step"] = self.soup.best_step


def main(out_dir: Path, method: str) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0)
    module = CausalLMModule(tiny_llama(), lr=1e-2, weight_decay=0.0, warmup_steps=1, max_steps=MERGE_STEP)
    soup = MonoSoupCallback(method=method, every_n_steps=MERGE_STEP, val_batches=2)
    out: dict = {}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=MERGE_STEP, val_check_interval=2,
                        check_val_every_n_epoch=None, limit_val_batches=2, num_sanity_val_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Dump(soup, "pre", out), soup, Dump(soup, "post", out)],
                        default_root_dir=str(out_dir))
    trainer.fit(module, datamodule=BlocksDataModule())
    out["records"] = soup.records
    torch.save(out, out_dir / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "monosoup")
