"""Export one fine-tuned variant as a BitDelta artifact (format v1).

    python compress/run.py variant=coder
    python compress/run.py variant=coder granularity=row paths.root=/scratch/df

Reads ``conf/export.yaml``: diffs ``models/<variant>/`` against ``models/base/`` and writes
``artifacts/<variant>/`` (see ``deltafleet.compress.bitdelta.compress``), then prints a one-line summary.
A setting export.yaml does not have (``+granulariti=row``) is refused before any work (``error: ...``,
status 2); an output folder whose file system takes no more (full, a file-size limit) ends the export
with ``export: cannot write ... to out_dir <folder>: <cause>`` (status 1), nothing written. Ctrl-C
before the output folder is renamed into place is status 130, the folder as it was; after it, status 0
(``deltafleet.cli.interruptible``): the export is complete.
"""
from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from deltafleet.compress.bitdelta import check_variant_name, compress, export_hf
from deltafleet.cli import (flag, output_write, refuse_unknown_settings, require_checkpoints, stop_on_sigterm,
                            user_errors)


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    refuse_unknown_settings(cfg, "export.yaml")  # a misspelt +key: `error: ...`, status 2, before any work
    stop_on_sigterm()  # a stopped export leaves no half artifact
    # a Ctrl-C once the output folder is renamed into place interrupts nothing: status 0, not 130
    with user_errors("export", output=cfg.hf_out_dir if cfg.format == "hf" else cfg.out_dir):
        from deltafleet.threads import set_threads

        set_threads(cfg)
        return _main(cfg)


def _main(cfg: DictConfig) -> dict:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    variant = cfg.variant.name
    if cfg.variant.init != "base":
        raise ValueError(f"variant={variant} is the base itself, not a fine-tune of it: nothing to export "
                         f"(export a variant, e.g. variant=coder)")
    if cfg.format not in ("bitdelta", "hf"):
        raise ValueError(f"format must be 'bitdelta' or 'hf', got {cfg.format!r}")
    check_variant_name(variant)
    overwrite, force = flag(cfg, "overwrite"), flag(cfg, "force")
    require_checkpoints(cfg, None if cfg.format == "hf" else variant)
    if cfg.format == "hf":  # any engine can serve the variant from a plain HF checkpoint
        with output_write("export", "the Hugging Face checkpoint", "hf_out_dir", cfg.hf_out_dir):
            out = export_hf(cfg.base_dir, cfg.out_dir, cfg.hf_out_dir, force=force, overwrite=overwrite,
                            max_shard_bytes=cfg.max_shard_bytes)
        print(f"{variant}: W_base + α·sign(Δ) from {cfg.out_dir} → {out} (Hugging Face checkpoint)")
        return {"hf_checkpoint": str(out)}
    with output_write("export", "the artifact", "out_dir", cfg.out_dir):  # a full disk: one line, not a traceback
        manifest = compress(
            cfg.base_dir,
            cfg.finetuned_dir,
            cfg.out_dir,
            variant=variant,
            granularity=cfg.granularity,
            max_shard_bytes=cfg.max_shard_bytes,
            show_progress=True,
            overwrite=overwrite,
            provenance={
                "run_id": f"export/{variant}/{run_dir.name}",
                "config": OmegaConf.to_container(cfg, resolve=True),
            },
        )
    s = manifest["stats"]
    bf16_bytes = 2 * s["parameters"]
    print(
        f"{variant}: {s['parameters']:,} params ({s['compressed_parameters']:,} 1-bit, "
        f"{s['full_parameters']:,} full), {s['bytes']:,} bytes, "
        f"{s['bits_per_parameter']:.3f} bits/param, {bf16_bytes / max(s['bytes'], 1):.1f}x smaller "
        f"than a bf16 copy → {cfg.out_dir}"
    )
    return manifest


if __name__ == "__main__":
    from deltafleet.cli import run_script

    run_script(main)
