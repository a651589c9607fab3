"""Train the base or fine-tune a variant, then export the variant as a BitDelta artifact.

    python train/run.py variant=base                 # tokenizer + tiny Llama base from scratch
    python train/run.py variant=coder                # fine-tune models/base on data/coder
    python train/run.py variant=math logger=csv      # same numbers without Weights & Biases
    python train/run.py -m variant=coder,math,writer,legal

Composes ``conf/train.yaml``, builds the model (from the ``model`` shape preset, or from
``models/base`` for a variant), fits it with a Lightning ``Trainer``, writes a Hugging Face
checkpoint to ``models/<variant>/`` atomically, and reports held-out loss on the variant's
domain for the base and for the result. For a variant it then writes ``artifacts/<variant>/``
(BitDelta format v1) and reports the held-out loss of the BitDelta-reconstructed model too.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

try:
    import train  # noqa: F401  (installed with `pip install -e .`)
except ImportError:  # `python train/run.py` from a checkout without the editable install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from compress.atomic import staged_dir, write_text
from train.datamodule import TextDataModule
from train.module import CausalLMModule, heldout_loss


def build_model(cfg: DictConfig, tokenizer):
    """A new ``LlamaForCausalLM`` of the ``model`` preset's shape, or one loaded from ``base_dir``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if cfg.variant.init == "scratch":
        if cfg.model.name_or_path:
            return AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=torch.float32).train()
        shape = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k not in ("name", "name_or_path")}
        shape["vocab_size"] = len(tokenizer)
        config = LlamaConfig(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
        return LlamaForCausalLM(config)
    if cfg.variant.init == "base":
        # from_pretrained returns the model in eval mode; Lightning keeps each module's mode
        return AutoModelForCausalLM.from_pretrained(cfg.base_dir, dtype=torch.float32).train()
    raise ValueError(f"variant.init must be 'scratch' or 'base', got {cfg.variant.init!r}")


def load_tokenizer(cfg: DictConfig, run_dir: Path):
    """The family tokenizer: trained on the base's corpus for ``init=scratch``, else read from ``base_dir``."""
    from transformers import AutoTokenizer

    if cfg.variant.init == "scratch" and not cfg.model.name_or_path:
        from train.tokenizer import train_tokenizer

        corpus = Path(cfg.paths.data_dir) / cfg.variant.domain / "train.jsonl"
        if not corpus.is_file():
            raise FileNotFoundError(f"{corpus} not found: run `make data` first")
        return train_tokenizer([corpus], cfg.model.vocab_size, run_dir / "tokenizer",
                               model_max_length=cfg.model.max_position_embeddings)
    src = cfg.model.name_or_path if cfg.variant.init == "scratch" else cfg.base_dir
    return AutoTokenizer.from_pretrained(src)


def save_checkpoint(model, tokenizer, out_dir: Path, extra: dict) -> None:
    """Write model + tokenizer (Hugging Face format) and ``training.json`` to ``out_dir`` atomically."""
    with staged_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "training.json").write_text(json.dumps(extra, indent=2) + "\n")


def train(cfg: DictConfig) -> dict:
    """Run one training job described by ``cfg`` (see module docstring); returns the final metrics."""
    L.seed_everything(cfg.seed, workers=True)
    variant, domain = cfg.variant.name, cfg.variant.domain
    run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(cfg.paths.output_dir)
    if cfg.variant.init == "base" and not (Path(cfg.base_dir) / "config.json").is_file():
        raise FileNotFoundError(f"no base model at {cfg.base_dir}: run `make base` first")

    tokenizer = load_tokenizer(cfg, run_dir)
    model = build_model(cfg, tokenizer)
    dm = TextDataModule(cfg.paths.data_dir, domain, tokenizer, cfg.variant.seq_len, cfg.variant.batch_size,
                        num_workers=cfg.num_workers, seed=cfg.seed)
    dm.setup()
    test_blocks = dm.blocks["test"]
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[train] variant={variant} domain={domain} params={n_params / 1e6:.2f}M "
          f"train_blocks={len(dm.blocks['train'])}x{cfg.variant.seq_len} steps={cfg.trainer.max_steps}", flush=True)

    logger = hydra.utils.instantiate(cfg.logger)
    logger.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    metrics: dict = {"variant": variant, "domain": domain, "parameters": n_params}
    try:
        before = heldout_loss(model, test_blocks, cfg.variant.batch_size, cfg.eval_batches)
        metrics["heldout/initial_loss"] = before
        module = CausalLMModule(model, lr=cfg.variant.lr, weight_decay=cfg.variant.weight_decay,
                                warmup_steps=cfg.variant.warmup_steps, max_steps=cfg.trainer.max_steps,
                                min_lr_ratio=cfg.variant.min_lr_ratio)
        trainer = hydra.utils.instantiate(cfg.trainer, logger=logger, default_root_dir=str(run_dir))
        t0 = time.perf_counter()
        trainer.fit(module, datamodule=dm)
        metrics["train_seconds"] = time.perf_counter() - t0
        model = module.model.float().cpu()
        after = heldout_loss(model, test_blocks, cfg.variant.batch_size, cfg.eval_batches)
        metrics["heldout/loss"] = after
        if cfg.variant.init == "base":
            metrics["heldout/base_loss"] = before
            metrics["heldout/gain"] = before - after
        print(f"[train] held-out loss on {domain}/test: "
              + (f"base {before:.4f} -> {variant} {after:.4f} (gain {before - after:+.4f} nats/token)"
                 if cfg.variant.init == "base" else f"initial {before:.4f} -> {variant} {after:.4f}"), flush=True)

        out_dir = Path(cfg.out_dir)
        if trainer.is_global_zero:
            save_checkpoint(model, tokenizer, out_dir, {"run_id": run_dir.name, **metrics})
            print(f"[train] wrote {out_dir}", flush=True)

        if cfg.variant.init == "base" and cfg.export.enabled and trainer.is_global_zero:
            metrics.update(export_and_check(cfg, run_dir, test_blocks, before, after))
        logger.log_metrics({k: v for k, v in metrics.items() if isinstance(v, float)})
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        if trainer.is_global_zero:
            save_metrics = json.loads((out_dir / "training.json").read_text())
            save_metrics.update(metrics)
            write_text(out_dir / "training.json", json.dumps(save_metrics, indent=2) + "\n")
    finally:
        _finish_wandb()
    return metrics


def export_and_check(cfg: DictConfig, run_dir: Path, test_blocks: torch.Tensor, base_loss: float,
                     ft_loss: float) -> dict:
    """Export ``artifacts/<variant>/`` and measure the held-out loss of the BitDelta model."""
    from transformers import AutoModelForCausalLM

    from compress.bitdelta import compress, load_artifact, materialize

    out = Path(cfg.export.out_dir)
    manifest = compress(cfg.base_dir, cfg.out_dir, out, variant=cfg.variant.name,
                        granularity=cfg.export.granularity,
                        provenance={"run_id": run_dir.name, "config": OmegaConf.to_container(cfg, resolve=True)})
    artifact = load_artifact(out)
    approx = AutoModelForCausalLM.from_pretrained(cfg.base_dir, dtype=torch.float32)
    approx.load_state_dict(materialize(cfg.base_dir, artifact), strict=False)
    bd_loss = heldout_loss(approx, test_blocks, cfg.variant.batch_size, cfg.eval_batches)
    gain = base_loss - ft_loss
    recovered = (base_loss - bd_loss) / gain if gain > 0 else float("nan")
    stats = manifest["stats"]
    print(f"[export] {out}: {stats['bytes'] / 1e6:.2f} MB, {stats['bits_per_parameter']:.3f} bits/param; "
          f"held-out loss base {base_loss:.4f} | fine-tune {ft_loss:.4f} | BitDelta {bd_loss:.4f} "
          f"(gain recovered {recovered:.2f})", flush=True)
    return {"heldout/bitdelta_loss": bd_loss, "heldout/bitdelta_gain_recovered": recovered,
            "export/bits_per_parameter": float(stats["bits_per_parameter"]),
            "export/bytes": float(stats["bytes"])}


def _finish_wandb() -> None:
    """Close the W&B run (if one was started) so Hydra multiruns start clean ones."""
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish()


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    metrics = train(cfg)
    return metrics["heldout/loss"]


if __name__ == "__main__":
    main()
