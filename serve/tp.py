"""Tensor parallelism of the served model and of its variants' deltas (Megatron-LM, Shoeybi et al.
2019, §3; as gpt-fast's ``tp.py`` does for one model).

Every rank holds a slice of every attention and MLP block:

* column parallel — ``q_proj``, ``k_proj``, ``v_proj`` (whole heads: ``n_head/W`` query and
  ``n_kv/W`` key/value heads per rank), ``gate_proj``, ``up_proj``: rows ``[r·N/W, (r+1)·N/W)`` of the
  weight and of the bias; a variant's signs and row scales α are cut the same way;
* row parallel — ``o_proj``, ``down_proj``: columns ``[r·K/W, (r+1)·K/W)`` of the weight and sign
  bytes ``[r·K/(8W), …)`` (so K/W must be a multiple of 8); α multiplies whole rows and is kept
  whole; each rank's product is a partial sum, added across ranks by one ``all_reduce``; the bias
  is added by rank 0 only.

Embeddings, norms and the head are replicated. The KV cache of a rank holds its heads only. With
one process per GPU (NCCL) or per CPU (gloo, the tests), each rank runs the same forward on the
same inputs and gets the same logits.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from deltafleet.serve.delta import VariantDelta
from deltafleet.serve.model import Attention, DeltaLinear
from deltafleet.serve.request import TensorParallelError

log = logging.getLogger(__name__)

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def _kind(name: str) -> str | None:
    """``"column"``, ``"row"`` or None (replicated) for a Hugging Face parameter name."""
    parts = name.split(".")
    mod = parts[-2] if len(parts) >= 2 else ""
    return "column" if mod in COLUMN else "row" if mod in ROW else None


def _cut(t: Tensor, dim: int, rank: int, world: int, name: str) -> Tensor:
    if t.shape[dim] % world:
        raise ValueError(f"{name}: dimension {dim} of size {t.shape[dim]} does not split over {world} ranks")
    n = t.shape[dim] // world
    return t.narrow(dim, rank * n, n).contiguous()


def slice_for(name: str, sl, rank: int, world: int) -> Tensor:
    """This rank's slice of checkpoint tensor ``name`` from a safetensors slice ``sl`` (read from disk
    as that slice only), or from a whole tensor ``sl`` (a view of it: ``.clone()`` it to free the rest)."""
    kind = _kind(name)
    shape = list(sl.shape) if isinstance(sl, Tensor) else sl.get_shape()
    if kind == "column":  # rows of the weight, or of its bias
        n = shape[0] // world
        return sl[rank * n:(rank + 1) * n]
    if kind == "row" and len(shape) == 2:  # columns of the weight (a row-parallel bias stays whole)
        k = shape[1] // world
        return sl[:, rank * k:(rank + 1) * k]
    return sl[:]


def heads_split(args, world: int) -> bool:
    """Whether ``args``' (a :class:`deltafleet.serve.model.ModelArgs`) query and key-value heads both
    divide over ``world`` ranks."""
    return not (args.n_head % world or args.n_local_heads % world)


def shard_model(model, rank: int, world: int, group=None) -> None:
    """Cut ``model`` (a :class:`deltafleet.serve.model.Transformer`) in place to rank ``rank``'s slice of
    ``world``; row-parallel linears all-reduce their outputs over ``group``.

    Raises:
        ValueError: if the heads, the MLP width or K/W of a row-parallel layer (in sign bytes) do not
            divide over ``world``.
    """
    a = model.args
    if not heads_split(a, world):
        raise ValueError(f"{a.n_head} query / {a.n_local_heads} key-value heads do not split over {world} ranks")
    if world == 1:
        return
    for mod in model.modules():
        if isinstance(mod, Attention):
            mod.n_head //= world
            mod.n_kv //= world
        if not isinstance(mod, DeltaLinear):
            continue
        kind = _kind(f"{mod.name}.weight")
        if kind == "column":
            mod.weight = torch.nn.Parameter(_cut(mod.weight.data, 0, rank, world, mod.name), requires_grad=False)
            if mod.bias is not None:
                mod.bias = torch.nn.Parameter(_cut(mod.bias.data, 0, rank, world, mod.name), requires_grad=False)
        elif kind == "row":
            k = mod.weight.shape[1]
            if (k // world) % 8 or k % world:
                raise ValueError(f"{mod.name}: K = {k} over {world} ranks is not a multiple of 8 per rank "
                                 "(sign bytes cannot be cut)")
            mod.weight = torch.nn.Parameter(_cut(mod.weight.data, 1, rank, world, mod.name), requires_grad=False)
            if mod.bias is not None and rank != 0:
                mod.bias = None  # added once, by rank 0
            mod.tp_group = group if group is not None else dist.group.WORLD
    model.args.n_head //= world
    model.args.n_local_heads //= world
    model.tp = (rank, world)
    if model.layers[0].self_attn.qkv is not None:  # fused before the cut: fuse the slices again
        model.fuse_projections()


def shard_sign(name: str, sign: Tensor, alpha: Tensor, rank: int, world: int) -> tuple[Tensor, Tensor]:
    """This rank's part of one sign-compressed weight ``name`` (HF name): packed signs uint8
    ``[N, ceil(K/8)]`` → ``[N/W, ceil(K/8)]`` (column parallel) or ``[N, K/(8W)]`` (row parallel), and its
    scale α fp32 ``[]`` (kept) or ``[N]`` (cut with the rows; whole for row parallel). Replicated
    weights (embeddings, head) are returned as they are.

    Raises:
        ValueError: if the cut dimension does not split over ``world``.
    """
    kind = _kind(name)
    if kind == "column":
        return _cut(sign, 0, rank, world, name), alpha if alpha.dim() == 0 else _cut(alpha, 0, rank, world, name)
    if kind == "row":
        return _cut(sign, 1, rank, world, name), alpha  # α scales whole rows
    return sign, alpha


def shard_delta(delta, rank: int, world: int):
    """A variant's :class:`deltafleet.serve.delta.VariantDelta` cut like :func:`shard_model` cuts the model."""

    if world == 1:
        return delta
    out = object.__new__(VariantDelta)
    out.name, out.signs, out.alphas, out.full, out.betas = delta.name, {}, {}, {}, {}
    for name, s in delta.signs.items():
        out.signs[name], out.alphas[name] = shard_sign(name, s, delta.alphas[name], rank, world)
    for name, b in getattr(delta, "betas", {}).items():  # β scales columns: cut with K (row parallel)
        out.betas[name] = _cut(b, 0, rank, world, name) if _kind(name) == "row" else b
    for name, t in delta.full.items():
        kind = _kind(name)
        if kind == "column":
            out.full[name] = _cut(t, 0, rank, world, name) if name.endswith(".bias") else t
        elif kind == "row" and name.endswith(".bias"):
            if rank == 0:
                out.full[name] = t
        else:
            out.full[name] = t
    return out



# --------------------------------------------------------------------------------------------
# Serving with one process per rank: rank 0 runs the HTTP server and the scheduler and sends every
# step to the other ranks, which run the same forward on their slices. A rank that dies or stops
# answering fails the group for good (TPContext.fail): the server stops, and the launcher
# (serve/run.py) names the rank.
# --------------------------------------------------------------------------------------------


# A follower's wait for rank 0's next command: an idle server sends none, so it has no deadline of its
# own. gloo takes one anyway: ten years, past any server's uptime (and well within its clock's range).
COMMAND_WAIT = timedelta(days=3650)


def loopback_interface() -> str:
    """The name of this machine's loopback interface: ``lo`` (Linux) or ``lo0`` (macOS, the BSDs).

    Raises:
        OSError: if it has neither.
    """
    names = {name for _, name in socket.if_nameindex()}
    found = next((name for name in ("lo", "lo0") if name in names), None)
    if found is None:
        raise OSError(f"no loopback interface (lo or lo0) among this machine's interfaces "
                      f"({', '.join(sorted(names))}): set GLOO_SOCKET_IFNAME to it")
    return found


def gloo_on_loopback(host: str) -> None:
    """Put the sockets of every gloo group this process creates on the loopback interface, where the
    ranks meet at a loopback ``host`` (the server's 127.0.0.1) and ``GLOO_SOCKET_IFNAME`` does not
    name an interface already (the user's choice stands). Left to itself, gloo binds and connects on
    the address the machine's hostname resolves to, which is often an interface other machines
    reach: its ranks would listen there, with no address of the server's configuration to say so.
    gloo reads the variable when a group is created, so this comes before the first."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        loopback = host == "localhost"
    if loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()


def connect(rank: int, world: int, backend: str, host: str, port: int, timeout_s: float) -> TPContext:
    """Join the tensor-parallel group as ``rank`` of ``world``: the default process group (``backend``:
    NCCL on GPUs, gloo on the CPU), which the all-reduces use, and a gloo group for rank 0's commands.

    The ranks meet at rank 0's ``TCPStore`` on ``host:port``. Rank 0 binds its listening socket to
    ``host`` itself and hands it to the store: a store that binds its own listens on every interface
    (``*:port``), whatever address the ranks use, and would take connections from other machines.
    The gloo groups' own sockets (the control group's, and the all-reduces' on the CPU) go on the
    loopback interface with a loopback ``host`` (:func:`gloo_on_loopback`), not on the address the
    machine's hostname resolves to.

    Every collective waits at most ``timeout_s`` (``tp_timeout_s``) for the other ranks, so that a
    rank that stops answering (stopped, hung) fails the requests it holds up instead of hanging them
    and the server's shutdown: rank 0's commands (a rank busy elsewhere, e.g. reading a variant, must
    take the next one within it) and every rank's all-reduces. The exception is a follower waiting
    for rank 0's next command (:data:`COMMAND_WAIT`): an idle server sends none for as long as it is
    idle, and rank 0's end closes the connections that wait. Both groups are created by every rank."""
    timeout = timedelta(seconds=timeout_s)
    gloo_on_loopback(host)
    fd = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen()
        fd = listener.detach()  # the store's from now on: not closed with the socket object
    store = dist.TCPStore(host, port, world, rank == 0, timeout, master_listen_fd=fd)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else COMMAND_WAIT)
    return TPContext(rank, world, None, control, timeout_s)


class TPContext:
    """One rank's place in a tensor-parallel server.

    Args:
        rank, world: this process and the number of processes (one per GPU).
        group: the process group of the all-reduces (NCCL on GPUs); None: the default group.
        control: a gloo group over the same ranks for the commands rank 0 sends (pickled objects).
    """

    def __init__(self, rank: int, world: int, group=None, control=None, timeout_s: float | None = None):
        self.rank, self.world, self.group, self.control = rank, world, group, control
        self.timeout_s = timeout_s  # what every collective waits at most (connect); None: not known here
        self.lock = threading.RLock()  # rank 0: one command, and the forward it announces, at a time
        self.failed: str | None = None  # rank 0: why the group failed (fail), once it has
        self._failing = threading.Lock()

    @property
    def shard(self) -> tuple:
        return self.rank, self.world, self.group

    def send(self, cmd: tuple) -> None:
        """Rank 0: announce ``cmd`` to every rank (in order; hold :attr:`lock` around it and its work).

        Raises:
            TensorParallelError: the group failed, now (:meth:`fail`) or before: nothing is sent on it
                any more.
        """
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        try:
            self._broadcast(cmd)
        except RuntimeError as e:  # gloo's errors, a rank gone or a timeout, are RuntimeErrors
            raise self.fail(e) from e

    def _broadcast(self, cmd: tuple) -> None:
        dist.broadcast_object_list([cmd], src=0, group=self.control)

    def gather(self, reply) -> list:
        """Every rank, after a command that asks for replies (``load``): a follower sends ``reply``
        (picklable) to rank 0; rank 0 (``reply`` ignored) returns the other ranks' replies, rank 1's
        first, and raises :class:`TensorParallelError` as :meth:`send` does."""
        if self.rank != 0:
            self._gather(reply)
            return []
        if self.failed is not None:
            raise TensorParallelError(self.failed)
        try:
            return self._gather(None)[1:]
        except RuntimeError as e:
            raise self.fail(e) from e

    def _gather(self, reply) -> list:
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(reply, out, dst=0, group=self.control)
        return out

    def fail(self, error: BaseException) -> TensorParallelError:
        """Rank 0: the group failed with ``error``, raised by a collective (or by anything in a step:
        a step that did not run to its end on every rank leaves the ranks out of step). Records why,
        once, and logs it as one line (with the traceback only for an error that is not a
        collective's, a bug's); the engine then refuses every request and the server shuts down
        (serve/engine.py, serve/run.py). Returns the error of the requests that were being generated,
        naming what happened: the first failure's, whichever thread calls."""
        with self._failing:
            if self.failed is None:
                self.failed, known = (error.reason, True) if isinstance(error, TensorParallelError) else \
                    self._reason(error)
                log.error("%s", TensorParallelError(self.failed), exc_info=None if known else error)
        return TensorParallelError(self.failed)

    def _reason(self, error: BaseException) -> tuple[str, bool]:
        """What ``error`` says happened to the group, and whether it is a collective's failure. gloo
        raises plain RuntimeErrors: its message tells a timeout from a closed connection. With two
        ranks the other one is rank 1; with more, rank 0 cannot tell which (the launcher names it)."""
        text = str(error).lower()
        who = "tensor-parallel rank 1" if self.world == 2 else f"one of tensor-parallel ranks 1-{self.world - 1}"
        within = "in time" if self.timeout_s is None else f"within tp_timeout_s={self.timeout_s:g} s"
        if "timed out" in text or "timeout" in text:
            return f"{who} did not answer {within} (stopped or hung)", True
        if "connection" in text or "peer" in text or "broken pipe" in text:
            return f"{who} is gone (its connection closed: it exited or was killed)", True
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return (f"a tensor-parallel step failed on rank 0 ({type(error).__name__}{': ' + first if first else ''}), "
                "which leaves the ranks out of step"), False

    def recv(self) -> tuple:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]
