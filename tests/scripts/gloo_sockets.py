"""One rank of a two-rank tensor-parallel group (gloo, CPU) made by ``serve.tp.connect``, launched by
tests/test_serve_tp.py: it runs one all-reduce (the default group) and one command (the control
group), then writes the addresses of its TCP sockets to ``OUT.<rank>`` as a JSON list.

    python tests/scripts/gloo_sockets.py RANK PORT OUT
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from deltafleet.serve.tp import connect


def tcp_addresses() -> set[str]:
    """The addresses of this process's TCP sockets: each one's local address, and a connected one's
    peer (an IPv4-mapped IPv6 address as IPv4), from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            for hex_addr in (fields[1], fields[2]) if fields[3] != "0A" else (fields[1],):  # 0A: LISTEN
                raw = bytes.fromhex(hex_addr.split(":")[0])  # 32-bit words, each in host (little-endian) order
                ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                found.add(str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip))
    return found


def main(rank: int, port: int, out: str) -> None:
    ctx = connect(rank, 2, "gloo", "127.0.0.1", port, 30)
    try:
        dist.all_reduce(torch.ones(2))
        ctx.send(("ping",)) if rank == 0 else ctx.recv()
        Path(f"{out}.{rank}").write_text(json.dumps(sorted(tcp_addresses())))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
