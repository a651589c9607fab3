"""The LightningModule's pieces against plain references: loss, schedule, packing."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers

from deltafleet.train.datamodule import load_blocks
from deltafleet.train.module import CausalLMModule, heldout_loss


def tiny_llama(vocab: int = 97) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def test_heldout_loss_matches_hf_loss():
    model = tiny_llama()
    blocks = torch.randint(0, 97, (5, 16), generator=torch.Generator().manual_seed(1))
    # HF averages over all predicted tokens of the batch; with equal-length blocks the
    # token-weighted mean over batches of 2 must equal the one-batch mean.
    ref = model(input_ids=blocks, labels=blocks).loss.item()
    assert heldout_loss(model, blocks, batch_size=2) == pytest.approx(ref, rel=1e-5)
    # max_batches evaluates a prefix only
    ref2 = model(input_ids=blocks[:2], labels=blocks[:2]).loss.item()
    assert heldout_loss(model, blocks, batch_size=2, max_batches=1) == pytest.approx(ref2, rel=1e-5)


def test_lr_schedule_warmup_then_cosine_to_floor():
    module = CausalLMModule(tiny_llama(), lr=1e-3, weight_decay=0.1, warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    conf = module.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    lrs = []
    for _ in range(24):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1e-3 / 4)
    assert lrs[3] == pytest.approx(1e-3)
    mid = 4 + 8  # halfway through the cosine
    assert lrs[mid] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))))
    assert lrs[20] == pytest.approx(1e-4) and lrs[23] == pytest.approx(1e-4)
    # weight decay only on matrices
    decay_group, no_decay_group = opt.param_groups
    assert all(p.dim() >= 2 for p in decay_group["params"]) and decay_group["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay_group["params"]) and no_decay_group["weight_decay"] == 0.0


def test_load_blocks_packs_documents_with_eos(tmp_path):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    docs = ["def f(x):\n    return x + 1\n", "Emma Woodhouse, handsome, clever, and rich.", "Answer: 42"]
    tok.train_from_iterator(docs * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "test.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs * 3))
    blocks = load_blocks(tmp_path, "d", "test", hf, seq_len=8, cache_dir=tmp_path / "cache")
    stream = []
    for t in docs * 3:
        stream += hf(t, add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    n = len(stream) // 8
    assert blocks.dtype == torch.long and blocks.shape == (n, 8)
    assert blocks.flatten().tolist() == stream[: n * 8]
    with pytest.raises(FileNotFoundError, match="make data"):
        load_blocks(tmp_path, "d", "train", hf, seq_len=8)
    with pytest.raises(ValueError, match="fewer than one block"):
        load_blocks(tmp_path, "d", "test", hf, seq_len=10_000, cache_dir=tmp_path / "cache")


def test_a_resume_is_checked_before_training(tmp_path):
    """``ckpt_path`` is refused when it is missing, another variant's, trained at another learning
    rate (Lightning would restore its optimizer and schedule, and the run's recorded lr would be
    wrong), or already at ``max_steps`` (Lightning would skip training and leave nothing to export)."""
    from deltafleet.train.run import check_resume

    ckpt = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}, "global_step": 200, "hyper_parameters": {"variant": "writer", "lr": 1e-3}}, ckpt)
    check_resume(str(ckpt), "writer", 201)  # one step left: fine
    check_resume(str(ckpt), "writer", 201, 1e-3)
    check_resume(None, "writer", 10)
    with pytest.raises(ValueError, match=r"was trained at lr 0.001, this run asks for 0.0005: a resume keeps"):
        check_resume(str(ckpt), "writer", 201, 5e-4)
    with pytest.raises(ValueError, match="is at step 200, at or past max_steps=160: nothing would be trained"):
        check_resume(str(ckpt), "writer", 160)
    with pytest.raises(ValueError, match="is a checkpoint of variant 'writer', not 'legal'"):
        check_resume(str(ckpt), "legal", 500)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_resume(str(tmp_path / "missing.ckpt"), "writer", 500)
    # found by a fresh user: a coder run's checkpoint resumed under variant=math (the same variant.name)
    # trained on math, and under variant=base as a model from scratch
    torch.save({"state_dict": {}, "global_step": 20, "hyper_parameters": {"variant": "r2", "lr": 1e-3,
                                                                           "domain": "coder", "init": "base"}}, ckpt)
    check_resume(str(ckpt), "r2", 40, 1e-3, "coder", "base")
    with pytest.raises(ValueError, match=r"was trained on data of domain 'coder', this run on 'math' \(variant.domain\)"):
        check_resume(str(ckpt), "r2", 40, 1e-3, "math", "base")
    with pytest.raises(ValueError, match=r"was trained on initial weights 'base', this run on 'scratch' \(variant.init\)"):
        check_resume(str(ckpt), "r2", 40, 1e-3, "coder", "scratch")
    # found by a fresh user: the schedule's other settings and a LoRA rank were not compared (the rank
    # failed in Lightning's load_state_dict, a 56-line traceback after the data and the model loaded)
    sched = {"weight_decay": 0.0, "warmup_steps": 10, "min_lr_ratio": 0.1}
    lora = {"model.layers.0.q_proj.lora_A.default.weight": torch.zeros(16, 64),
            "model.layers.0.q_proj.lora_B.default.weight": torch.zeros(64, 16)}
    torch.save({"state_dict": lora, "global_step": 20,
                "hyper_parameters": {"variant": "r2", "lr": 1e-3, **sched}}, ckpt)
    check_resume(str(ckpt), "r2", 80, 1e-3, schedule={**sched, "warmup_steps": 10.0}, lora_r=16)  # a longer run
    for key, value in (("weight_decay", 0.1), ("warmup_steps", 5), ("min_lr_ratio", 0.0)):
        with pytest.raises(ValueError, match=rf"was trained with {key} {sched[key]!r}, this run asks for {value!r} "
                                             rf"\(variant.{key}\): .* resume with variant.{key}={sched[key]!r}$"):
            check_resume(str(ckpt), "r2", 80, 1e-3, schedule={**sched, key: value}, lora_r=16)
    with pytest.raises(ValueError, match=r"holds LoRA adapters of rank 16, this run asks for lora.r=8: resume it "
                                         r"with lora.r=16$"):
        check_resume(str(ckpt), "r2", 80, 1e-3, lora_r=8)
    with pytest.raises(ValueError, match=r"is a LoRA run's \(rank 16\), this run a full fine-tune: resume it with "
                                         r"variant.adapter=lora lora.r=16$"):
        check_resume(str(ckpt), "r2", 80, 1e-3)
    torch.save({"state_dict": {"model.layers.0.q_proj.weight": torch.zeros(64, 64)}, "global_step": 20,
                "hyper_parameters": {"variant": "r2", "lr": 1e-3}}, ckpt)
    with pytest.raises(ValueError, match=r"holds a full fine-tune, no LoRA adapters, this run asks for lora.r=8: "
                                         r"resume it with variant.adapter=null$"):
        check_resume(str(ckpt), "r2", 80, 1e-3, lora_r=8)
    check_resume(str(ckpt), "r2", 80, 1e-3, schedule=sched)  # a checkpoint that records no schedule
    # found by a fresh user: ckpt_path=last took a diverged run's checkpoint, trained NaNs to the end,
    # and only then refused to write them
    torch.save({"state_dict": {"model.layers.0.q_proj.weight": torch.full((4, 4), float("nan"))}, "global_step": 20,
                "hyper_parameters": {"variant": "r2", "lr": 1e-3}}, ckpt)
    with pytest.raises(ValueError, match=r"holds NaN or inf weights \(model.layers.0.q_proj.weight\): its run "
                                         r"diverged; train again at a lower learning rate$"):
        check_resume(str(ckpt), "r2", 80, 1e-3)


def test_lightning_settings_are_checked_as_lightning_takes_them():
    """``trainer.precision`` and ``trainer.val_check_interval`` are refused before any work where
    Lightning would refuse them after the data and model load (or fail in its loop: 0), and taken in
    every form Lightning takes: found by fresh users, 32.0 passed the check, and Lightning's time
    forms of the interval were refused."""
    from omegaconf import OmegaConf

    from deltafleet.train.run import _check_trainer

    for precision in ("32-true", "bf16-mixed", 16, "16", "bf16", None):
        _check_trainer(OmegaConf.create({"trainer": {"precision": precision}}))
    for precision in ("banana", 32.0, True):
        with pytest.raises(ValueError, match=r"^trainer.precision must be one of Lightning's .*; got "):
            _check_trainer(OmegaConf.create({"trainer": {"precision": precision}}))
    for interval in (1, 50, 0.25, 1.0, "00:00:00:05", {"seconds": 5}, None):
        _check_trainer(OmegaConf.create({"trainer": {"val_check_interval": interval}}))
    for interval in (0, -1, 1.5, 0.0, True):
        with pytest.raises(ValueError, match=r"^trainer.val_check_interval must be a whole number of steps"):
            _check_trainer(OmegaConf.create({"trainer": {"val_check_interval": interval}}))


def test_a_precision_lightning_takes_is_checked_without_importing_lightning():
    """Lightning's import took about 5 of the 8.6 s in which ``train/run.py`` refused a missing base:
    a precision of :data:`LIGHTNING_PRECISIONS` (the installed Lightning's own list) passes without
    it; any other value still asks the installed Lightning."""
    import typing

    from lightning.fabric.connector import _PRECISION_INPUT

    from deltafleet.train.run import LIGHTNING_PRECISIONS

    def values(t) -> list:
        return [v for a in typing.get_args(t) for v in (values(a) if typing.get_args(a) else [a])]

    assert sorted(map(repr, LIGHTNING_PRECISIONS)) == sorted(map(repr, values(_PRECISION_INPUT)))
    code = ("import sys; from omegaconf import OmegaConf; from deltafleet.train.run import _check_trainer; "
            "_check_trainer(OmegaConf.create({'trainer': {'precision': 'bf16-mixed'}})); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:] + out.stdout


def test_ckpt_path_last_is_the_newest_checkpoint_of_the_variants_runs(tmp_path):
    """Lightning takes ``ckpt_path="last"``; found by a fresh user, it was refused as a missing file.
    It names the newest ``checkpoints/last.ckpt`` of the variant's runs, never another variant's."""
    import os

    from omegaconf import OmegaConf

    from deltafleet.train.run import last_checkpoint

    cfg = OmegaConf.create({"paths": {"output_dir": str(tmp_path)}, "variant": {"name": "writer"}})
    with pytest.raises(FileNotFoundError, match=rf"^ckpt_path=last: no run of variant writer under "
                                                rf"{tmp_path}/train/writer has a checkpoint"):
        last_checkpoint(cfg)
    for i, (variant, run) in enumerate([("writer", "b"), ("writer", "a"), ("legal", "c"), ("writer", "d")]):
        f = tmp_path / "train" / variant / run / "checkpoints" / "last.ckpt"
        f.parent.mkdir(parents=True)
        f.write_bytes(b"x")
        os.utime(f, (1_000_000 + i, 1_000_000 + (i if run != "d" else -5)))  # d: the oldest
    (tmp_path / "train" / "writer" / "e" / "checkpoints").mkdir(parents=True)  # a run with none (this one)
    assert last_checkpoint(cfg) == tmp_path / "train" / "writer" / "a" / "checkpoints" / "last.ckpt"
