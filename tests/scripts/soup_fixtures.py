"""Tiny model and data shared by tests/test_callback.py and the DDP script it launches."""
from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader

VOCAB = 97


def tiny_llama(seed: int = 0):
    """A random LlamaForCausalLM: hidden 32, 2 layers, 4 heads (2 kv), vocab 97."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def arithmetic_blocks(n: int, seq_len: int, seed: int) -> torch.Tensor:
    """int64 ``[n, seq_len]``: token t of a block is ``(a + b·t) mod 97`` — learnable, so val loss moves."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, VOCAB, (n, 1), generator=g)
    b = torch.randint(1, 8, (n, 1), generator=g)
    return (a + b * torch.arange(seq_len)) % VOCAB


class BlocksDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 4, seq_len: int = 16, n_train: int = 64, n_val: int = 16):
        super().__init__()
        self.train = arithmetic_blocks(n_train, seq_len, seed=1)
        self.val = arithmetic_blocks(n_val, seq_len, seed=2)
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True,
                          generator=torch.Generator().manual_seed(0))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=self.batch_size, shuffle=False)
