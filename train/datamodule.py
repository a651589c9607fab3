"""Token blocks from ``data/<domain>/{train,val,test}.jsonl`` for causal-LM training.

Documents are tokenized with the family's tokenizer, each followed by ``<|endoftext|>``,
concatenated in file order and cut into blocks of ``seq_len`` tokens (the usual "group texts"
packing); the trailing partial block is dropped. Loading and tokenizing go through Hugging Face
``datasets`` so large corpora stream from Arrow files instead of Python lists.
"""
from __future__ import annotations

from pathlib import Path

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader

from deltafleet.train.data import SPLITS, split_file  # noqa: F401 (re-exported: the data module's files)


def load_blocks(
    data_dir: str | Path,
    domain: str,
    split: str,
    tokenizer,
    seq_len: int,
    cache_dir: str | Path | None = None,
) -> torch.Tensor:
    """Tokenize one split of one domain into packed blocks.

    Args:
        data_dir: folder holding ``<domain>/<split>.jsonl`` (records with a ``text`` field, or
            ``messages``: a conversation, rendered by the tokenizer's own chat template).
        domain: e.g. ``"coder"`` or ``"general"``.
        split: ``"train"``, ``"val"`` or ``"test"``.
        tokenizer: a Hugging Face tokenizer with an ``eos_token_id``.
        seq_len: tokens per block.
        cache_dir: where ``datasets`` keeps its Arrow cache (default: ``<data_dir>/.cache``).

    Returns:
        int64 tensor ``[num_blocks, seq_len]``.

    Raises:
        FileNotFoundError: if the split file is missing (run ``make data``).
        ValueError: if the split holds fewer than ``seq_len`` tokens, or conversations and the
            tokenizer has no chat template.
    """
    path = split_file(data_dir, domain, split)
    cache_dir = Path(cache_dir) if cache_dir else Path(data_dir) / ".cache"
    ds = datasets.load_dataset("json", data_files=str(path), split="train", cache_dir=str(cache_dir))
    eos = tokenizer.eos_token_id

    chat = "messages" in ds.column_names
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{path} holds conversations, but the tokenizer has no chat template to render them")

    def tokenize(batch):
        texts = [tokenizer.apply_chat_template(m, tokenize=False) for m in batch["messages"]] if chat else batch["text"]
        ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids]}

    ds = ds.map(tokenize, batched=True, remove_columns=ds.column_names, desc=f"tokenize {domain}/{split}")
    flat = torch.tensor([t for ids in ds["ids"] for t in ids], dtype=torch.long)
    n = flat.numel() // seq_len
    if n == 0:
        raise ValueError(f"{path} holds {flat.numel()} tokens, fewer than one block of {seq_len}")
    return flat[: n * seq_len].view(n, seq_len)


class TextDataModule(L.LightningDataModule):
    """Packed token blocks of one domain: shuffled train batches, ordered val/test batches."""

    def __init__(self, data_dir: str | Path, domain: str, tokenizer, seq_len: int, batch_size: int,
                 num_workers: int = 0, seed: int = 0):
        super().__init__()
        self.data_dir, self.domain, self.tokenizer = Path(data_dir), domain, tokenizer
        self.seq_len, self.batch_size, self.num_workers, self.seed = seq_len, batch_size, num_workers, seed
        self.blocks: dict[str, torch.Tensor] = {}

    def setup(self, stage: str | None = None) -> None:
        for split in SPLITS:
            if split not in self.blocks:
                self.blocks[split] = load_blocks(self.data_dir, self.domain, split, self.tokenizer, self.seq_len)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.blocks[split], batch_size=self.batch_size, shuffle=shuffle,
                          drop_last=shuffle, num_workers=self.num_workers, generator=generator)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
