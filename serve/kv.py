"""The paged KV cache's bookkeeping: fixed-size blocks, a block table per sequence (vLLM's
PagedAttention, Kwon et al. 2023).

A sequence's keys and values live in blocks of ``block_size`` tokens anywhere in one pool; its block
table lists them in order, so token ``t`` is at slot ``table[t // block_size] * block_size + t %
block_size``. A sequence takes blocks as it grows and gives them all back when it ends or is
preempted, so the pool holds the live tokens of every sequence rather than ``max_batch`` full
contexts. :class:`BlockPool` only counts and hands out block ids; the tensors the ids index, and
the attention that reads them, belong to the model runner.

A leaf module.
"""
from __future__ import annotations

import math


class OutOfBlocksError(RuntimeError):
    """The pool has too few free blocks for an allocation (the scheduler holds admission or preempts)."""


class BlockPool:
    """``n_blocks`` KV blocks of ``block_size`` tokens and the block table of each sequence.

    Freed blocks are reused before never-used ones, the last freed first, and never-used ones go out
    lowest id first, so a lightly loaded server keeps its sequences in few, warm blocks.

    Raises:
        ValueError: ``n_blocks`` or ``block_size`` < 1.
    """

    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"n_blocks and block_size must be ≥ 1, got {n_blocks} and {block_size}")
        self.n_blocks, self.block_size = n_blocks, block_size
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: the lowest id on top
        self._tables: dict[object, list[int]] = {}

    @staticmethod
    def blocks_for_memory(free_bytes: int, bytes_per_block: int, utilization: float = 0.9) -> int:
        """How many blocks fit in ``utilization`` of ``free_bytes`` (the memory left once the base and
        the delta slots are resident, as vLLM's ``gpu_memory_utilization`` sizes its pool)."""
        if not 0 < utilization <= 1:
            raise ValueError(f"utilization must be in (0, 1], got {utilization}")
        return max(0, int(free_bytes * utilization) // bytes_per_block)

    def blocks_needed(self, n_tokens: int) -> int:
        """Blocks that hold ``n_tokens`` tokens."""
        return math.ceil(n_tokens / self.block_size)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """The fraction of blocks in use (vLLM's ``kv_cache_usage_perc``, as a fraction)."""
        return 1 - len(self._free) / self.n_blocks

    def table(self, seq) -> list[int]:
        """The blocks of ``seq``, in token order (empty for a sequence holding none)."""
        return self._tables.get(seq, [])

    def capacity(self, seq) -> int:
        """Tokens ``seq`` can hold without another block."""
        return len(self.table(seq)) * self.block_size

    def extra_blocks(self, seq, n_tokens: int) -> int:
        """Blocks ``seq`` must take to hold ``n_tokens`` tokens in all."""
        return max(0, self.blocks_needed(n_tokens) - len(self.table(seq)))

    def can_grow(self, seq, n_tokens: int) -> bool:
        return self.extra_blocks(seq, n_tokens) <= len(self._free)

    def grow(self, seq, n_tokens: int) -> list[int]:
        """Give ``seq`` blocks for ``n_tokens`` tokens in all; returns its block table.

        Raises:
            OutOfBlocksError: too few free blocks (nothing is taken then).
        """
        extra = self.extra_blocks(seq, n_tokens)
        if extra > len(self._free):
            raise OutOfBlocksError(f"{extra} blocks needed, {len(self._free)} free of {self.n_blocks}")
        table = self._tables.setdefault(seq, [])
        table += [self._free.pop() for _ in range(extra)]
        return table

    def release(self, seq) -> int:
        """Give every block of ``seq`` back (it ended, or is preempted); returns how many."""
        table = self._tables.pop(seq, [])
        self._free += reversed(table)
        return len(table)

    def slots(self, seq, start: int, stop: int) -> list[int]:
        """The cache slots of tokens ``start … stop − 1`` of ``seq`` (which must hold them)."""
        table, bs = self._tables[seq], self.block_size
        return [table[t // bs] * bs + t % bs for t in range(start, stop)]
