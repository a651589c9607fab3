"""The paged KV cache's block pool (serve/kv.py): allocation as sequences grow, release, slots, the
pool size from free memory, and refusal without side effects when blocks run out."""
from __future__ import annotations

import random

import pytest

from deltafleet.serve.kv import BlockPool, OutOfBlocksError


def test_sequences_take_blocks_as_they_grow_and_give_them_all_back():
    pool = BlockPool(8, block_size=4)
    assert pool.grow("a", 5) == [0, 1] and pool.capacity("a") == 8
    assert pool.grow("b", 1) == [2]
    assert pool.grow("a", 8) == [0, 1]  # still fits
    assert pool.grow("a", 9) == [0, 1, 3]
    assert pool.free_blocks == 4 and pool.usage == 0.5
    assert pool.slots("a", 3, 10) == [3, 4, 5, 6, 7, 12, 13]  # token t: table[t // 4] * 4 + t % 4
    assert pool.release("a") == 3 and pool.table("a") == [] and pool.release("a") == 0
    assert pool.grow("c", 4) == [0]  # freed blocks are reused, lowest first
    assert pool.free_blocks == 6


def test_out_of_blocks_takes_nothing():
    pool = BlockPool(3, block_size=2)
    pool.grow("a", 4)
    assert not pool.can_grow("b", 3) and pool.can_grow("b", 2)
    with pytest.raises(OutOfBlocksError, match="2 blocks needed, 1 free of 3"):
        pool.grow("b", 3)
    assert pool.table("b") == [] and pool.free_blocks == 1


def test_blocks_are_never_shared_under_random_traffic():
    rng = random.Random(0)
    pool = BlockPool(64, block_size=16)
    lengths: dict[int, int] = {}
    for step in range(5000):
        seq = rng.randrange(20)
        if seq in lengths and rng.random() < 0.1:
            pool.release(seq)
            del lengths[seq]
            continue
        want = lengths.get(seq, 0) + rng.randrange(1, 40)
        if pool.can_grow(seq, want):
            pool.grow(seq, want)
            lengths[seq] = want
        else:
            with pytest.raises(OutOfBlocksError):
                pool.grow(seq, want)
        held = [b for s in lengths for b in pool.table(s)]
        assert len(held) == len(set(held)) == 64 - pool.free_blocks
        assert all(len(pool.table(s)) == pool.blocks_needed(n) for s, n in lengths.items())


def test_the_pool_is_sized_from_the_memory_left():
    # 7B-shaped (32 layers, 32 kv heads of 128, bf16): one 16-token block is 16 * 2 * 32 * 32 * 128 * 2 bytes
    per_block = 16 * 2 * 32 * 32 * 128 * 2
    assert per_block == 8 * 2**20
    assert BlockPool.blocks_for_memory(100 * 2**30, per_block, 0.9) == int(100 * 2**30 * 0.9) // per_block == 11520
    assert BlockPool.blocks_for_memory(2**20, per_block) == 0
    with pytest.raises(ValueError):
        BlockPool.blocks_for_memory(2**30, per_block, 1.5)
    with pytest.raises(ValueError):
        BlockPool(0, 16)
