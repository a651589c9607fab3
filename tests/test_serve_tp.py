"""Tensor parallelism (serve/tp.py): two ranks (gloo, one process each, on the CPU) serving slices of
the model and of the variants' deltas give the logits of the whole model — one variant per
sequence, and a decode step mixing the base and two variants."""
from __future__ import annotations

import contextlib

import re
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from deltafleet.compress.bitdelta import load_artifact
from deltafleet.serve.batch import DeltaSlots
from deltafleet.serve.delta import VariantDelta, artifact_stamp
from deltafleet.serve.loading import load_model
from deltafleet.serve.runner import ModelRunner, StepInput
from deltafleet.serve.tp import TPContext, shard_delta, shard_model

PROMPTS = [[3, 17, 42, 9, 120, 7], [5, 6, 7], [200, 11, 31, 4]]


class WholeRank0(TPContext):
    """Rank 0 of ``world`` serving the whole model itself (no other rank takes part); the commands it
    sends, in ``sent``."""

    def __init__(self, world: int):
        super().__init__(0, world, timeout_s=30)
        self.sent = []

    @property
    def shard(self):
        return 0, 1, None

    def _broadcast(self, cmd):
        self.sent.append(cmd)


def _run(model, coder, writer) -> dict:
    """Logits of every prompt with the base / coder / writer, then one mixed decode step."""
    out = {}
    with torch.inference_mode():
        for name, d in (("base", None), ("coder", coder), ("writer", writer)):
            ids = torch.tensor([PROMPTS[0]])
            out[name] = model(ids, torch.arange(ids.shape[1]), None, d)[0].float()
        slots = DeltaSlots(model, 2)
        views = {"coder": slots.put(coder), "writer": slots.put(writer)}
        runner = ModelRunner(model, slots, n_blocks=12, block_size=8, max_batch=4, max_seq_len=32)
        tables = [[2 + 3 * b, 1 + 3 * b, 3 * b] for b in range(3)]
        variants = [-1, views["coder"].slot, views["writer"].slot]
        step = StepInput()
        for b, p in enumerate(PROMPTS):  # the three prompts prefilled in one step
            step.chunks.append((len(step.tokens), len(p), 0, tables[b]))
            step.tokens += p
            step.positions += range(len(p))
            step.kv_slots += [tables[b][0] * 8 + t for t in range(len(p))]
            step.variants += [variants[b]] * len(p)
            step.sample.append(len(step.tokens) - 1)
        nxt = runner.forward(step).float().argmax(-1).tolist()
        pos = [len(p) for p in PROMPTS]
        step = StepInput(nxt, pos, [tables[b][0] * 8 + q for b, q in enumerate(pos)], variants, 3, tables, [],
                         [0, 1, 2])
        out["mixed_step"] = runner.forward(step).float()
        out["first_tokens"] = torch.tensor(nxt)
    return out


def _load(base_dir: str, art_dir: str):
    model = load_model(base_dir)
    coder = VariantDelta(load_artifact(Path(art_dir) / "coder"))
    writer = VariantDelta(load_artifact(Path(art_dir) / "writer"))
    return model, coder, writer


def _worker(rank: int, world: int, base_dir: str, art_dir: str, init: str, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model, coder, writer = _load(base_dir, art_dir)
        shard_model(model, rank, world)
        res = _run(model, shard_delta(coder, rank, world), shard_delta(writer, rank, world))
        res["q_rows"] = torch.tensor(model.layers[0].self_attn.q_proj.weight.shape[0])
        torch.save(res, f"{out}.{rank}")
        # No rank tears gloo down while its peer may still be inside the last collective: without
        # this barrier one rank sometimes aborted ("terminate called without an active exception").
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _layout_family(root: Path, layout: str) -> tuple[Path, Path]:
    """A base and two variants (``coder``, ``writer``) whose deltas touch every kind of tensor of
    ``layout``: matrices, biases (Qwen2's q/k/v; Llama's o_proj and MLP biases, row parallel) and norms;
    with a tied head for ``llama-bias-tied``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from deltafleet.compress.bitdelta import compress

    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1)
    if layout == "qwen2-bias":
        make = lambda: Qwen2ForCausalLM(Qwen2Config(**kw, tie_word_embeddings=False)).eval()  # noqa: E731
    else:
        make = lambda: LlamaForCausalLM(LlamaConfig(**kw, attention_bias=True, mlp_bias=True,  # noqa: E731
                                                    tie_word_embeddings=True)).eval()
    base = make()
    with torch.no_grad():
        for n, p in base.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if n.endswith("norm.weight") else 0.0, 0.2)
    base.save_pretrained(root / "base")
    for i, v in enumerate(("coder", "writer")):
        ft = make()
        torch.manual_seed(10 + i)
        sd = {k: t.clone() for k, t in base.state_dict().items()}
        for k, t in sd.items():
            t += (0.5 * t.std() if t.dim() == 2 else 0.2) * torch.randn_like(t)
        ft.load_state_dict(sd)
        ft.save_pretrained(root / v)
        compress(root / "base", root / v, root / "artifacts" / v, variant=v, granularity="row" if i else "matrix")
    return root / "base", root / "artifacts"


@pytest.mark.parametrize("layout", ["llama", "qwen2-bias", "llama-bias-tied"])
def test_two_ranks_give_the_logits_of_the_whole_model(tiny_family, tmp_path, layout):
    if layout == "llama":
        base_dir, art_dir = tiny_family.base_dir, tiny_family.artifacts_dir
    else:
        base_dir, art_dir = _layout_family(tmp_path, layout)
    model, coder, writer = _load(str(base_dir), str(art_dir))
    assert layout == "llama" or any(k.endswith(".bias") for k in coder.full)  # the biases' deltas are exercised
    want = _run(model, coder, writer)
    world = 2
    mp.spawn(_worker, args=(world, str(base_dir), str(art_dir),
                            f"file://{tmp_path / 'pg'}", str(tmp_path / "res")), nprocs=world, join=True)
    for rank in range(world):
        got = torch.load(tmp_path / f"res.{rank}")
        assert int(got["q_rows"]) == model.layers[0].self_attn.q_proj.weight.shape[0] // world  # really cut
        assert torch.equal(got["first_tokens"], want["first_tokens"])
        for k in ("base", "coder", "writer", "mixed_step"):
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4, msg=lambda s: f"rank {rank} {k}: {s}")
    assert not torch.allclose(want["coder"], want["base"], atol=1e-3)  # the variants matter


def test_shapes_that_do_not_split_are_named(tiny_family):
    model = load_model(tiny_family.base_dir)
    with pytest.raises(ValueError, match=r"4 query / 2 key-value heads do not split over 3 ranks"):
        shard_model(model, 0, 3)
    model.layers[0].mlp.down_proj.weight = torch.nn.Parameter(torch.zeros(64, 24), requires_grad=False)
    with pytest.raises(ValueError, match=r"down_proj: K = 24 over 2 ranks is not a multiple of 8 per rank"):
        shard_model(model, 1, 2)


def _tp_server(tiny_family, out: Path, *overrides: str):
    """``serve/run.py tp=2`` (gloo) over the tiny family on free ports, with more settings
    ``overrides``, its output in ``out/server.log``: ``(launcher process, url, log file)``."""
    import os
    import socket
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    log = open(out / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "serve/run.py", f"base_dir={tiny_family.base_dir}",
                             f"artifacts_dir={tiny_family.artifacts_dir}", "model.name=tiny", f"port={ports[0]}",
                             f"tp_port={ports[1]}", "tp=2", "threads=1", "log_level=warning",
                             f"hydra.run.dir={out}", *overrides], cwd=repo, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    return proc, f"http://127.0.0.1:{ports[0]}", log


def _listening(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp and tcp6 write them) of the sockets listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(addr)
    return found


def test_a_tensor_parallel_server_answers_like_one_process(tiny_family, tmp_path):
    """``serve/run.py tp=2`` (two gloo processes; rank 0 serves HTTP) through the real openai client:
    greedy answers for the base and each variant, sent together, equal the one-process engine's."""
    import json
    import subprocess
    import time

    import httpx
    import openai

    from deltafleet.serve.engine import Engine, SamplingParams
    from tests.conftest import complete_concurrently, stop_server, wait_healthy

    proc, url, log = _tp_server(tiny_family, tmp_path)
    try:
        wait_healthy(proc, url, tmp_path / "server.log", 120)
        # found by a fresh user: the ranks' store listened on every interface (*:tp_port)
        tp_port = int(next(a for a in proc.args if a.startswith("tp_port=")).split("=")[1])
        assert _listening(tp_port) == ["0100007F"]  # 127.0.0.1 alone, as /proc/net/tcp writes it
        ref = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny")
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        jobs = [(m, p) for m in ("tiny", "tiny-coder", "tiny-writer") for p in ("def main(", "The quick")]
        got = complete_concurrently(client, jobs, 8, 120)
        for m, p in jobs:
            assert got[(m, p)] == ref.complete(m, p, SamplingParams(max_tokens=8, temperature=0)).text, (m, p)
        # Found by a fresh user: SIGTERM to the launcher killed it (143) and cut every request off with a
        # plain-text 500. The launcher passes it to rank 0, which shuts down as one process does: the
        # stream running goes on to its end, the other rank is stopped, and everything exits 0.
        ranks = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                text=True).stdout.split()]
        assert len(ranks) >= 2, ranks
        body = {"model": "tiny-coder", "prompt": "def ", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert r.status_code == 200 and next(line for line in lines if line).startswith("data: {")
            proc.terminate()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        def alive(pid: int) -> bool:  # a zombie has exited
            try:
                return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
            except FileNotFoundError:
                return False

        deadline = time.time() + 30
        while any(alive(pid) for pid in ranks):
            assert time.time() < deadline, "a rank outlived the launcher"
            time.sleep(0.1)
        assert "Traceback" not in (tmp_path / "server.log").read_text()
    finally:
        stop_server(proc, log, 30)


@pytest.mark.parametrize("layout", ["qwen2-bias", "llama-bias-tied"])
def test_mixed_decode_rows_equal_each_sequence_alone_with_biases_and_tied_head(tmp_path, layout):
    """One process: the mixed decode step of ``_run`` (base, coder, writer rows) against each sequence
    run alone with its own variant — with per-row bias deltas and a tied embedding/head."""
    base_dir, art_dir = _layout_family(tmp_path, layout)
    model, coder, writer = _load(str(base_dir), str(art_dir))
    got = _run(model, coder, writer)
    with torch.inference_mode():
        for b, (p, d) in enumerate(zip(PROMPTS, (None, coder, writer))):
            ids = torch.tensor([p + [int(got["first_tokens"][b])]])
            alone = model(ids, torch.arange(ids.shape[1]), None, d)[0, -1].float()
            torch.testing.assert_close(got["mixed_step"][b], alone, rtol=1e-4, atol=1e-4, msg=lambda s: f"row {b}: {s}")


def test_column_scales_are_cut_with_the_input_features():
    """Granularity rowcol: β scales the input columns, so a row-parallel weight (o_proj, down_proj: K
    cut over the ranks) gets its rank's slice of β, as its signs get their slice of K; a column-parallel
    one (q, k, v, gate, up: N cut) keeps β whole, and the embedding (replicated) too."""
    from deltafleet.kernels import pack_signs

    g = torch.Generator().manual_seed(0)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (32, 64), "model.layers.0.mlp.down_proj.weight": (64, 128),
              "model.embed_tokens.weight": (100, 64)}
    delta = object.__new__(VariantDelta)
    delta.name, delta.full = "v", {}
    delta.signs = {k: pack_signs(torch.randn(*s, generator=g)) for k, s in shapes.items()}
    delta.alphas = {k: torch.rand(s[0], generator=g) for k, s in shapes.items()}
    delta.betas = {k: torch.rand(s[1], generator=g) for k, s in shapes.items()}
    for rank in range(2):
        part = shard_delta(delta, rank, 2)
        q, down, emb = shapes
        assert torch.equal(part.betas[q], delta.betas[q]) and torch.equal(part.betas[emb], delta.betas[emb])
        assert torch.equal(part.betas[down], delta.betas[down][64 * rank:64 * (rank + 1)])
        assert part.signs[down].shape == (64, 8) and part.alphas[down].shape == (64,)


def test_sigterm_while_the_ranks_start_leaves_none_behind(tiny_family, tmp_path):
    """SIGTERM to the launcher while the ranks load (before rank 0 serves) ends rank 0 on it before it
    can shut down gracefully: the launcher stops the other rank and exits 128 + 15, with no traceback
    and no rank left behind."""
    import signal
    import time

    from tests.conftest import process_alive, started_ranks

    proc, _, out = _tp_server(tiny_family, tmp_path)
    log = tmp_path / "server.log"
    with out:
        try:
            ranks = started_ranks(proc, log)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        finally:
            if proc.poll() is None:
                proc.kill()
    time.sleep(0.5)
    assert not [pid for pid in ranks if process_alive(pid)], "a rank is left"
    assert "Traceback" not in log.read_text(), log.read_text()[-2000:]


def _scripted_rank(i: int, plan: list[tuple[int, float]]) -> None:
    """Rank ``i`` of a launcher test: sleeps ``plan[i][1]`` seconds, then exits with ``plan[i][0]``, or
    for a negative one sends itself that signal (``-9``: dies of SIGKILL; ``-19``: stops, until killed)."""
    import os
    import time

    time.sleep(plan[i][1])
    if plan[i][0] < 0:
        os.kill(os.getpid(), -plan[i][0])
        time.sleep(60)
    os._exit(plan[i][0])


def _kill_scripted(ranks) -> list[int]:
    """The pids of ``ranks``' processes still running (a launcher that left them is wrong), killed, so
    that a failing test does not hang pytest's exit on a stopped one."""
    left = [p.pid for p in ranks.processes if p.is_alive()]
    for p in ranks.processes:
        if p.is_alive():
            p.kill()
            p.join()
    return left


@pytest.mark.parametrize("plan, signals, want", [
    ([(0, 0.0), (0, 0.2)], [], 0),        # both end well
    ([(2, 0.3), (2, 0.0)], [], 2),        # rank 1 fails first; rank 0 reaches the same start error
    ([(3, 0.0), (0, 60.0)], [], 3),       # rank 0 cannot bind its port; rank 1 would wait forever
    ([(3, 0.3), (2, 0.0)], [], 3),        # rank 1 fails first (2); rank 0's own status is the one reported
    ([(0, 0.0), (0, 60.0)], [], 1),       # rank 0 ends, rank 1 never does: stopped, and a failure
    ([(0, 0.0), (-19, 0.0)], [], 1),      # ... rank 1 stopped (SIGSTOP): SIGTERM cannot end it, SIGKILL does
    ([(0, 60.0), (0, 60.0)], [15], 143),  # a SIGTERM passed on to rank 0, which dies of it
], ids=["ok", "same-start-error", "port-taken", "rank-0-first", "rank-left-running", "rank-left-stopped", "sigterm"])
def test_the_launcher_reports_rank_0s_status_and_leaves_no_rank(plan, signals, want, monkeypatch):
    """``serve/run.py``'s ``_join_ranks`` over real rank processes: it returns 0 when every rank ends
    well, rank 0's own error status (2, or 3 for a port it could not bind) when ranks fail, 1 when a
    rank outlives rank 0 past ``STOP_WAIT_S`` (killed if SIGTERM does not end it: a stopped one was
    left behind), and 128 + the signal passed on to rank 0 when rank 0 died of it; every rank has
    ended when it returns."""
    import os
    import signal

    from deltafleet.serve import run

    monkeypatch.setattr(run, "ERROR_WAIT_S", 1.0)
    monkeypatch.setattr(run, "STOP_WAIT_S", 1.0)
    ranks = mp.start_processes(_scripted_rank, args=(plan,), nprocs=len(plan), join=False, start_method="fork")
    try:
        if signals:
            os.kill(ranks.processes[0].pid, signal.SIGTERM)
        assert run._join_ranks(ranks, signals) == want
    finally:
        assert not _kill_scripted(ranks)


@pytest.mark.parametrize("plan, line", [
    ([(0, 60.0), (-9, 0.2)], r"tensor-parallel rank 1 \(pid \d+\) died of SIGKILL: the server stopped"),
    ([(4, 0.3), (-9, 0.0)], r"tensor-parallel rank 1 \(pid \d+\) died of SIGKILL: the server stopped"),
    ([(4, 0.3), (-19, 0.0)], r"tensor-parallel rank 1 \(pid \d+\) did not answer within tp_timeout_s=2 s "
                             r"\(stopped or hung\) and was killed: the server stopped"),
], ids=["rank-1-killed", "rank-1-killed-rank-0-failed", "rank-1-stopped"])
def test_the_launcher_names_the_rank_that_failed_the_group(plan, line, monkeypatch, capsys):
    """Found by a fresh user: ``kill -9`` of rank 1 ended the launcher with torch's traceback (status
    1), and a stopped rank 1 (SIGSTOP) was never killed. A rank dead of a signal, or rank 0 ending on
    its group's failure (``GROUP_FAILED``: a rank gone, or not answering within ``tp_timeout_s``) with
    a rank that does not end, makes ``_join_ranks`` end every rank (rank 0 on SIGTERM, as it shuts
    down; a stopped one with SIGKILL), print one line naming the rank and return ``GROUP_FAILED``."""
    from deltafleet.serve import run

    monkeypatch.setattr(run, "ERROR_WAIT_S", 1.0)
    monkeypatch.setattr(run, "STOP_WAIT_S", 1.0)
    ranks = mp.start_processes(_scripted_rank, args=(plan,), nprocs=len(plan), join=False, start_method="fork")
    try:
        assert run._join_ranks(ranks, [], timeout_s=2) == run.GROUP_FAILED
    finally:
        assert not _kill_scripted(ranks)
    err = capsys.readouterr().err
    assert re.fullmatch(f"error: {line}\n", err), err


def test_the_launcher_kills_a_rank_0_that_does_not_end_after_the_signal(monkeypatch, capsys):
    """Found by a fresh user: with a rank stopped, SIGTERM never ended the server. Past ``stop_after_s``
    (the grace, its answers and the others' stop) after the signal it passed on, ``_join_ranks`` kills
    every rank, says so, and returns 128 + the signal; here rank 0 is stopped, so the SIGTERM waits."""
    import os
    import signal
    import time

    from deltafleet.serve import run

    ranks = mp.start_processes(_scripted_rank, args=([(-19, 0.0), (0, 60.0)],), nprocs=2, join=False,
                               start_method="fork")
    try:
        pid = ranks.processes[0].pid
        deadline = time.time() + 30
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":  # stopped
            assert time.time() < deadline
            time.sleep(0.01)
        os.kill(pid, signal.SIGTERM)
        assert run._join_ranks(ranks, [signal.SIGTERM], stop_after_s=0.5) == 128 + signal.SIGTERM
    finally:
        assert not _kill_scripted(ranks)
    assert re.fullmatch(r"error: tensor-parallel rank 0 \(pid \d+\) did not shut down within 0.5 s of SIGTERM: "
                        r"every rank was killed\n", capsys.readouterr().err)


def test_the_launcher_reraises_a_rank_crash_without_a_status_of_its_own(monkeypatch):
    """A rank that crashes (status 1: a traceback of its own) while rank 0 has no error status to report
    is the launcher's error: ``_join_ranks`` raises torch's ``ProcessExitedException`` for it, after
    stopping rank 0."""
    from deltafleet.serve import run

    monkeypatch.setattr(run, "ERROR_WAIT_S", 0.5)
    ranks = mp.start_processes(_scripted_rank, args=([(0, 60.0), (1, 0.0)],), nprocs=2, join=False,
                               start_method="fork")
    with pytest.raises(mp.ProcessExitedException) as e:
        run._join_ranks(ranks, [])
    assert e.value.error_index == 1 and e.value.exit_code == 1
    assert not [p.pid for p in ranks.processes if p.is_alive()]


def test_a_follower_takes_a_variant_back_from_its_own_host_copy(tiny_family, tmp_path, monkeypatch):
    """Found by a fresh user: with one device slot, a variant evicted to rank 0's host tier and asked
    for again after its artifact folder was moved away came back from rank 0's host copy, while rank
    1 read the folder again, died (ArtifactError) and took the server down. A follower now keeps its
    own slice of a variant that leaves its slot and takes that back on a load from the host tier;
    after rank 0's ``drop`` it has none, and a load reads the folder (here: gone, so it answers rank 0
    why it took nothing)."""
    import shutil

    from deltafleet.serve.follower import run_follower

    art = tmp_path / "coder"
    shutil.copytree(tiny_family.artifacts_dir / "coder", art)
    src = str(art)
    puts = []
    put = DeltaSlots.put

    def record(self, delta, slot=None):  # what the slot holds after each load
        view = put(self, delta, slot)
        puts.append({k: v[view.slot].clone() for k, v in self.signs.items()})
        return view

    monkeypatch.setattr(DeltaSlots, "put", record)

    follower = _follower_of(art, tmp_path / ".coder-away")
    init = ("init", 1, 2, 64, "tiled", 4, 16, "sdpa", False)
    stamp = artifact_stamp(art)
    run_follower(follower([init, ("load", 7, src, 0, False, stamp), ("free", 0, True), ("move",),
                           ("load", 7, src, 0, True, stamp), ("free", 0, True), ("stop",)]),
                 str(tiny_family.base_dir), "cpu", torch.float32)
    assert len(puts) == 2 and puts[0].keys() == puts[1].keys()
    assert all(torch.equal(puts[0][k], puts[1][k]) for k in puts[0])  # rank 1's slice, as first read
    (tmp_path / ".coder-away").rename(art)
    # after rank 0's drop, and for a slot freed with nothing kept on rank 0 (a dropped variant, an old
    # version's last request): none here, so the load answers why it took nothing, and the follower goes on
    for free in [[("free", 0, True), ("drop", 7)], [("free", 0, False)]]:
        f = follower([init, ("load", 7, src, 0, False, stamp), *free, ("move",), ("load", 7, src, 0, True, stamp),
                      ("stop",)])
        run_follower(f, str(tiny_family.base_dir), "cpu", torch.float32)
        assert f.replies == [None, "tensor-parallel rank 1: its artifact changed or went on disk since rank 0 read it"]
        (tmp_path / ".coder-away").rename(art)


def _follower_of(art: Path, away: Path):
    """A rank 1 of 2 (``TPContext``) whose commands come from a list and whose replies to rank 0 are
    kept in ``replies``; the command ``("move",)`` moves the folder ``art`` to ``away``."""
    from deltafleet.serve.tp import TPContext

    class Follower(TPContext):
        def __init__(self, cmds):
            super().__init__(1, 2)
            self.cmds, self.replies = iter(cmds), []

        def recv(self):
            cmd = next(self.cmds)
            if cmd == ("move",):  # not a command: the user moves the folder away
                art.rename(away)
                cmd = next(self.cmds)
            return cmd

        def _gather(self, reply):
            self.replies.append(reply)

    return Follower


def test_a_follower_reads_only_the_version_rank_0_read(tiny_family, tmp_path, monkeypatch):
    """Found by a reviewer: rank 0 reads a variant, waits for room, then tells the other ranks to load
    it, and they read its folder only then. A folder re-exported meanwhile was served at two versions
    in one slot (rank 1 the new one); one removed meanwhile killed the follower and the server. The
    load now carries the stamp of what rank 0 read: a follower that finds another version (or none)
    takes nothing and says why, and the follower goes on serving."""
    import shutil

    from deltafleet.serve.follower import run_follower

    art = tmp_path / "coder"
    shutil.copytree(tiny_family.artifacts_dir / "coder", art)
    src, stamp = str(art), artifact_stamp(art)
    puts = []
    put = DeltaSlots.put
    monkeypatch.setattr(DeltaSlots, "put", lambda self, delta, slot=None: puts.append(slot) or put(self, delta, slot))
    # re-exported: a new folder with the writer's deltas renamed in (as export's atomic write does)
    shutil.copytree(tiny_family.artifacts_dir / "writer", tmp_path / ".coder-new")
    shutil.rmtree(art)
    (tmp_path / ".coder-new").rename(art)
    assert artifact_stamp(art) not in (None, stamp)
    init = ("init", 2, 2, 64, "tiled", 4, 16, "sdpa", False)
    f = _follower_of(art, tmp_path / ".coder-away")(
        [init, ("load", 1, src, 0, False, stamp), ("load", 2, src, 1, False, artifact_stamp(art)), ("move",),
         ("load", 3, src, 0, False, artifact_stamp(art)), ("stop",)])
    run_follower(f, str(tiny_family.base_dir), "cpu", torch.float32)
    changed = "tensor-parallel rank 1: its artifact changed or went on disk since rank 0 read it"
    assert f.replies == [changed, None, changed] and puts == [1]


def test_two_names_of_one_folder_keep_a_host_copy_each_on_a_follower(tiny_family, tmp_path):
    """Found by a reviewer: a follower kept its host copies by folder, rank 0 by model id, so two names
    served from one folder (``add_variant("alias", "coder")``) shared one copy on the follower: a drop
    of one took it, and a later load of the other from the host tier read the folder again (here
    moved away: the follower died). Both now key them by rank 0's read."""
    import shutil

    from deltafleet.serve.follower import run_follower

    art = tmp_path / "coder"
    shutil.copytree(tiny_family.artifacts_dir / "coder", art)
    src, stamp = str(art), artifact_stamp(art)
    init = ("init", 2, 2, 64, "tiled", 4, 16, "sdpa", False)
    f = _follower_of(art, tmp_path / ".coder-away")(
        [init, ("load", 1, src, 0, False, stamp), ("load", 2, src, 1, False, stamp), ("free", 0, True),
         ("free", 1, True), ("drop", 1), ("move",), ("load", 2, src, 0, True, stamp), ("stop",)])
    run_follower(f, str(tiny_family.base_dir), "cpu", torch.float32)
    assert f.replies == [None, None, None]


def _ranks_by_role(proc, url: str, log: Path) -> tuple[int, int]:
    """``(rank 0's pid, rank 1's pid)`` of the launcher ``proc`` of ``_tp_server``: rank 0 is the one
    that listens on ``url``'s port (its sockets, by inode, in ``/proc/net/tcp``)."""
    import os

    from tests.conftest import started_ranks

    port = int(url.rsplit(":", 1)[1])
    listening = {line.split()[9] for f in ("/proc/net/tcp", "/proc/net/tcp6") if os.path.exists(f)
                 for line in open(f).readlines()[1:]
                 if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"}
    ranks = [int(pid) for pid in started_ranks(proc, log)
             if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]  # not the resource tracker

    def serves(pid: int) -> bool:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd).removeprefix("socket:[").rstrip("]") in listening:
                    return True
            except OSError:  # closed meanwhile
                pass
        return False

    first = [pid for pid in ranks if serves(pid)]
    assert len(ranks) == 2 and len(first) == 1, (ranks, first)
    return first[0], next(pid for pid in ranks if pid != first[0])


def _held_up_request(url: str, rank1: int):
    """Stop rank 1 (SIGSTOP) and send a completion, which starts and waits in its step's collective;
    returns ``(thread, outcome)``: ``outcome["error"]`` is what the official ``openai`` client raised."""
    import os
    import signal
    import threading
    import time

    import httpx
    import openai

    os.kill(rank1, signal.SIGSTOP)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    outcome = {}

    def ask():
        try:
            outcome["text"] = client.completions.create(model="tiny", prompt="def ", max_tokens=8).choices[0].text
        except openai.APIError as e:
            outcome["error"] = e

    thread = threading.Thread(target=ask)
    thread.start()
    deadline = time.time() + 30
    while not re.search(r"^vllm:num_requests_running\S* 1\.0$", httpx.get(f"{url}/metrics").text, re.M):
        assert time.time() < deadline and thread.is_alive(), outcome
        time.sleep(0.05)
    return thread, outcome


@contextlib.contextmanager
def _held_up_group(tiny_family, tmp_path: Path, timeout_s: float):
    """A tp=2 server (``tp_timeout_s``) with rank 1 stopped under a completion in its step
    (:func:`_held_up_request`): yields ``(launcher, url, its log, (rank 0's pid, rank 1's), thread,
    outcome)``, and kills whatever is left at the end."""
    from tests.conftest import wait_healthy

    proc, url, out = _tp_server(tiny_family, tmp_path, f"tp_timeout_s={timeout_s}")
    log = tmp_path / "server.log"
    pids = ()
    with out:
        try:
            wait_healthy(proc, url, log, 120)
            pids = _ranks_by_role(proc, url, log)
            yield (proc, url, log, pids, *_held_up_request(url, pids[1]))
        finally:
            _kill_left(proc, pids)


def _ended_alone(proc, log: Path, pids: tuple[int, int], status: int, line: str) -> None:
    """The launcher ``proc`` exits with ``status`` with ``line`` (a regex) as its last line and no
    traceback in ``log``, and leaves no rank behind."""
    import time

    from tests.conftest import process_alive

    assert proc.wait(timeout=60) == status, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert re.fullmatch(line, text.strip().splitlines()[-1]), text[-3000:]
    deadline = time.time() + 10
    while any(process_alive(str(pid)) for pid in pids):
        assert time.time() < deadline, "a rank outlived the launcher"
        time.sleep(0.05)


def _kill_left(proc, pids) -> None:
    import os
    import signal

    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_killed_rank_fails_its_requests_and_stops_the_server(tiny_family, tmp_path):
    """Found by a fresh user: ``kill -9`` of rank 1 ended the requests with 500 ``internal_error`` and the
    launcher with torch's traceback (status 1). A request held up by the rank (here: in its step while
    rank 1 is stopped, then killed) now fails with 500 ``generation_failed`` naming the rank gone, /health
    stops saying ok, and the server stops: the launcher's last line names the rank and how it died,
    status ``GROUP_FAILED`` (4), no traceback, no rank left."""
    import os
    import signal

    import httpx

    with _held_up_group(tiny_family, tmp_path, 60) as (proc, url, log, pids, thread, outcome):
        os.kill(pids[1], signal.SIGKILL)
        thread.join(60)
        e = outcome.get("error")
        assert e is not None and e.status_code == 500 and e.code == "generation_failed", outcome
        assert "tensor-parallel rank 1 is gone" in e.message, e.message
        try:  # the server shuts down at once: refused, or a 503 until it has
            r = httpx.get(f"{url}/health", timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
        except httpx.TransportError:
            pass
        _ended_alone(proc, log, pids, 4, r"error: tensor-parallel rank 1 \(pid \d+\) died of SIGKILL: "
                                         r"the server stopped")


def test_a_rank_that_stops_answering_fails_its_requests_and_sigterm_ends_the_server(tiny_family, tmp_path):
    """Found by a fresh user: with rank 1 stopped (SIGSTOP) a request hung forever while /health said ok,
    and SIGTERM then never ended the server. Every collective now waits at most ``tp_timeout_s``: the
    request fails with 500 ``generation_failed`` saying rank 1 did not answer within it, and the server,
    told to stop meanwhile, ends: the launcher kills the stopped rank, names it, status 4, no traceback."""
    import signal

    with _held_up_group(tiny_family, tmp_path, 2) as (proc, url, log, pids, thread, outcome):
        proc.send_signal(signal.SIGTERM)
        thread.join(60)
        e = outcome.get("error")
        assert e is not None and e.status_code == 500 and e.code == "generation_failed", outcome
        assert "tensor-parallel rank 1 did not answer within tp_timeout_s=2 s" in e.message, e.message
        _ended_alone(proc, log, pids, 4, r"error: tensor-parallel rank 1 \(pid \d+\) did not answer within "
                                         r"tp_timeout_s=2 s \(stopped or hung\) and was killed: the server stopped")


def test_a_failed_group_ends_its_step_and_refuses_every_later_request(tiny_family, caplog):
    """Rank 0's side of a failed tensor-parallel group, in one process (a ``TPContext`` whose rank 1 is
    gone at the first step): the request in the step ends with 500 ``generation_failed`` naming the
    rank; ``/health`` and every later request answer 503 ``engine_failed``; the failure is logged as one
    line, without a traceback; nothing more is sent on the group."""
    from fastapi.testclient import TestClient

    from deltafleet.serve.app import create_app
    from deltafleet.serve.engine import Engine
    from tests.conftest import api_error

    class Gone(WholeRank0):  # of 2
        def _broadcast(self, cmd):
            super()._broadcast(cmd)
            if cmd[0] == "step":
                raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")

    group = Gone(2)
    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", tp=group)
    body = {"model": "tiny", "prompt": "def ", "max_tokens": 4}
    with TestClient(create_app(engine)) as tc, caplog.at_level("ERROR"):
        assert tc.get("/health").status_code == 200
        err = api_error(tc.post("/v1/completions", json=body), 500)
        assert err["code"] == "generation_failed"
        assert err["message"] == ("Generation failed: tensor-parallel rank 1 is gone (its connection closed: it exited "
                                  "or was killed): this server cannot generate any more and shuts down.")
        for r in (tc.get("/health"), tc.post("/v1/completions", json=body),
                  tc.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]})):
            err = api_error(r, 503)
            assert err["code"] == "engine_failed" and "tensor-parallel rank 1 is gone" in err["message"], err
        engine.shutdown()  # sends nothing: the group failed
    assert [c[0] for c in group.sent] == ["init", "step"]
    failed = [r for r in caplog.records if "tensor-parallel rank 1 is gone" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is None


def test_the_rendezvous_port_must_differ_from_the_servers(tiny_family):
    """Found by a fresh user: ``tp_port`` equal to ``port`` passed both checks (each was free), then the
    server could not listen, and the error blamed ``port``."""
    from omegaconf import OmegaConf

    from deltafleet.serve.run import check_tensor_parallel

    cfg = OmegaConf.create({"base_dir": str(tiny_family.base_dir), "tp": 2, "host": "127.0.0.1", "port": 8139,
                            "tp_port": 8139})
    with pytest.raises(ValueError, match=r"^tp_port \(8139, the ranks' rendezvous\) must differ from port"):
        check_tensor_parallel(cfg)


def test_rank_0_and_a_follower_serve_one_version_of_an_artifact_re_exported_while_it_loads(tiny_family, tmp_path,
                                                                                           monkeypatch):
    """Rank 0 (an engine serving the whole model, its other rank a real follower thread that loads its
    slices and skips the steps): an artifact re-exported between rank 0's read and the follower's
    (which starts with rank 0's, ``prefetch``, and here ends after the re-export) answers 503
    (transient, Retry-After) naming the change, takes no slot on either rank, and the next request
    serves the new version on both; the follower lives on."""
    import queue
    import shutil
    import threading
    import time

    from deltafleet.serve import follower as follower_module

    from fastapi.testclient import TestClient

    from deltafleet.serve.app import create_app
    from deltafleet.serve.engine import Engine
    from deltafleet.serve.follower import run_follower
    from deltafleet.serve.tp import TPContext
    from tests.conftest import api_error

    arts = tmp_path / "artifacts"
    shutil.copytree(tiny_family.artifacts_dir / "coder", arts / "coder")
    cmds, replies = queue.Queue(), queue.Queue()

    class Rank0(TPContext):  # the whole model (a world of one for its own slices), its commands to the follower
        def __init__(self):
            super().__init__(0, 1, timeout_s=30)

        def _broadcast(self, cmd):
            cmds.put(cmd)

        def _gather(self, reply):
            return [None, replies.get(timeout=60)]

    class Rank1(TPContext):
        def __init__(self):
            super().__init__(1, 2)

        def recv(self):
            while (cmd := cmds.get())[0] == "step":  # steps need the all-reduces: not here
                pass
            return cmd

        def _gather(self, reply):
            replies.put(reply)

    loaded = []
    put = DeltaSlots.put

    def record(self, delta, slot=None):  # which rank put which signs
        loaded.append(("rank1" if threading.current_thread().name == "rank1" else "rank0", delta.signs))
        return put(self, delta, slot)

    monkeypatch.setattr(DeltaSlots, "put", record)
    real_read = follower_module._read

    def late_read(*args):  # this rank reads slower than rank 0: after the re-export
        deadline = time.monotonic() + 60
        while not (tmp_path / ".done").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_read(*args)

    monkeypatch.setattr(follower_module, "_read", late_read)
    follower = threading.Thread(target=run_follower, name="rank1",
                                args=(Rank1(), str(tiny_family.base_dir), "cpu", torch.float32))
    follower.start()
    try:
        engine = Engine(tiny_family.base_dir, arts, family="tiny", tp=Rank0())
        read = engine._read_delta

        def read_then_re_export(model_id):  # the user re-exports coder (the writer's deltas) after rank 0 read it
            delta = read(model_id)
            if not (tmp_path / ".done").exists():
                shutil.copytree(tiny_family.artifacts_dir / "writer", tmp_path / ".coder-new")
                shutil.rmtree(arts / "coder")
                (tmp_path / ".coder-new").rename(arts / "coder")
                (tmp_path / ".done").touch()
            return delta

        monkeypatch.setattr(engine.cache, "_read", read_then_re_export)
        body = {"model": "tiny-coder", "prompt": "def ", "max_tokens": 2}
        with TestClient(create_app(engine)) as tc:
            r = tc.post("/v1/completions", json=body)
            err = api_error(r, 503)
            assert r.headers["Retry-After"] == "1"
            assert err["message"] == ("variant `tiny-coder` is unavailable: its artifact changed on disk while it "
                                      "was being loaded: retry"), err
            assert loaded == []
            assert tc.post("/v1/completions", json=body).status_code == 200
            engine.shutdown()
        follower.join(60)
        assert not follower.is_alive()
    finally:
        if follower.is_alive():
            cmds.put(("stop",))
            follower.join(60)
    writer = VariantDelta(load_artifact(tiny_family.artifacts_dir / "writer", force=True), "cpu", torch.float32)
    assert sorted(name for name, _ in loaded) == ["rank0", "rank1"]  # the second request's load, once each
    for name, signs in loaded:  # the new version on both ranks
        want = shard_delta(writer, 1, 2).signs if name == "rank1" else writer.signs
        assert signs.keys() == want.keys() and all(torch.equal(signs[k], want[k]) for k in want), name

def _gone_after_first_step():
    """Rank 0 serving the whole model itself (as tests/test_serve_tp.py's ``Rank0``/``Gone``), whose
    other rank answers every load and is gone at the first step."""
    from deltafleet.serve.tp import TPContext

    class Gone(TPContext):
        def __init__(self):
            super().__init__(0, 1, timeout_s=30)  # a world of one for its own slices
            self.sent = []

        def _broadcast(self, cmd):
            self.sent.append(cmd[0])
            if cmd[0] == "step" or "step" in self.sent:
                raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4242")

        def _gather(self, reply):
            return [None, None]

    return Gone()


@pytest.mark.parametrize("route, body", [
    ("/v1/unload_variant", {"variant": "coder"}),              # resident on the device
    ("/v1/load_variant", {"variant": "coder", "path": "writer"}),  # replaces it: unloads it first
    ("/v1/load_variant", {"variant": "coder"}),  # resident already: answered "loaded" without asking any rank
])
def test_hot_load_and_unload_after_the_group_failed_answer_503_engine_failed(tiny_family, route, body):
    """Found by a reviewer: once the group failed, every later request is answered 503 ``engine_failed``
    (docs/serving.md, "A rank that fails"), but unloading (or replacing) a variant on the device, whose
    ``free`` the failed group refused (a TensorParallelError, a RuntimeError), was answered 409
    ``variant_in_use``, and a load of a variant already on the device 200 from a server that cannot
    generate."""
    from fastapi.testclient import TestClient

    from deltafleet.serve.app import create_app
    from deltafleet.serve.engine import Engine
    from tests.conftest import api_error

    group = _gone_after_first_step()
    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", tp=group)
    with TestClient(create_app(engine)) as tc:
        engine.get_delta("tiny-coder")  # on the device (a load the ranks answered)
        assert engine.cache.tier("tiny-coder") == "device"
        err = api_error(tc.post("/v1/completions", json={"model": "tiny", "prompt": "def ", "max_tokens": 2}), 500)
        assert err["code"] == "generation_failed"
        assert engine.cache.snapshot()["tiny-coder"]["in_flight"] == 0  # nothing runs on it
        r = tc.post(route, json=body)
        engine.shutdown()
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", (r.status_code, r.text)


def _serve_cfg(tmp_path, tiny_family, *overrides: str):
    """conf/serve.yaml with ``overrides``, over a base whose config.json (the tiny family's, with 4 query
    and 4 key-value heads) splits over 4 ranks."""
    import json

    from hydra import compose, initialize_config_dir

    from tests.test_config import CONF

    config = json.loads((tiny_family.base_dir / "config.json").read_text())
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text(json.dumps({**config, "num_attention_heads": 4,
                                                               "num_key_value_heads": 4}))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="serve", overrides=[f"base_dir={tmp_path / 'base'}", f"paths.root={tmp_path}",
                                                       "port=8890", "tp_port=8891", *overrides])


def _two_gpus(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_more_ranks_than_gpus_is_refused_before_any_rank_starts(tiny_family, tmp_path, monkeypatch):
    """Found by a reviewer: ``device=cuda tp=4`` on a host with 2 GPUs passed every start check; ranks 2
    and 3 then crashed in ``torch.cuda.set_device(rank)`` while rank 0 waited at the rendezvous, and the
    launcher ended in torch's traceback instead of one error line."""
    from deltafleet.serve import run

    _two_gpus(monkeypatch)
    cfg = _serve_cfg(tmp_path, tiny_family, "device=cuda", "tp=4")
    with pytest.raises(ValueError, match=r"GPU|CUDA device"):
        run.check_settings(cfg)
        run.check_tensor_parallel(cfg)


def _record_rank(rank, cfg_dict, out):
    """``_rank_main`` of one rank, with the rendezvous and the serving replaced by records of the
    backend and device each rank would use (run in a forked child: it calls ``os.setpgrp``)."""
    import torch.distributed as dist

    from deltafleet.serve import follower, run, tp

    seen = {}
    torch.cuda.set_device = lambda r: seen.setdefault("set_device", r)
    tp.connect = lambda r, world, backend, *a: seen.setdefault("backend", backend) and tp.TPContext(r, world)
    run._serve = lambda cfg, device, ctx: seen.setdefault("device", device)
    follower.run_follower = lambda ctx, base, device, dtype: seen.setdefault("device", device)
    dist.destroy_process_group = lambda *a: None
    run._rank_main(rank, cfg_dict)
    out.put((rank, seen))


def test_a_numbered_cuda_device_with_tp_puts_every_rank_on_its_own_gpu_or_is_refused(tiny_family, tmp_path,
                                                                                     monkeypatch):
    """Found by a reviewer: ``tp=2`` starts one process per GPU (NCCL), but ``device=cuda:1`` with ``tp=2``
    put both ranks on cuda:1, all-reducing over gloo. Refused at start now (or, were it accepted, each
    rank must get its own GPU over NCCL)."""
    import multiprocessing

    from omegaconf import OmegaConf

    from deltafleet.serve import run

    _two_gpus(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    cfg = _serve_cfg(tmp_path, tiny_family, "device=cuda:1", "tp=2")
    try:
        run.check_settings(cfg)
        run.check_tensor_parallel(cfg)
    except ValueError:
        return  # refused at start, by name: fine
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_record_rank, args=(r, OmegaConf.to_container(cfg, resolve=True), q)) for r in range(2)]
    for p in procs:
        p.start()
    seen = dict(q.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    devices = [seen[r]["device"] for r in range(2)]
    assert len(set(devices)) == 2 and {seen[r]["backend"] for r in range(2)} == {"nccl"}, seen


def test_an_unsupported_architecture_with_tp_is_one_error_line_not_a_traceback(tiny_family, tmp_path):
    """Found by a reviewer: ``serve/run.py tp=2`` over a checkpoint of an architecture the server does
    not serve died in Hydra's traceback (NotImplementedError, status 1), not one line with status 2 as
    every other refused setting."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    base = tmp_path / "base"
    shutil.copytree(tiny_family.base_dir, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    r = subprocess.run([sys.executable, "serve/run.py", f"base_dir={base}", f"artifacts_dir={tmp_path / 'none'}",
                        "port=8896", "tp_port=8897", "tp=2", "threads=1", f"hydra.run.dir={tmp_path / 'run'}",
                        f"paths.root={tmp_path}"], cwd=repo, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert "Traceback" not in r.stderr and r.returncode == 2, (r.returncode, r.stderr[-1500:])
    assert r.stderr.startswith("error: ") and "gpt2" in r.stderr, r.stderr[-1500:]


def test_a_synthetic_family_with_pinned_variants_filling_the_slots_starts_or_is_refused_by_name(tmp_path):
    """Found by a reviewer: ``_preload`` generated every variant of a synthetic family, not as many as
    there are slots: with ``delta_cache.pinned`` holding every slot, the first variant past them found no
    room and the server died in a traceback at start."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import httpx

    from deltafleet.serve.bench import hydra_value, stdlib_tokenizer

    repo = Path(__file__).resolve().parents[1]
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    tok = tmp_path / "tok"
    stdlib_tokenizer(tok, shape["vocab_size"], shape["max_position_embeddings"])
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "serve/run.py",
                                 f"synthetic={hydra_value({'shape': shape, 'variants': 2, 'tokenizer_dir': str(tok)})}",
                                 "port=8898", "threads=1", "delta_cache.device_slots=1", "delta_cache.pinned=[v00]",
                                 "delta_cache.wait_timeout_s=1", f"hydra.run.dir={tmp_path / 'run'}",
                                 f"paths.root={tmp_path}"], cwd=repo, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(repo)})
        healthy = False
        try:
            deadline = time.time() + 90
            while proc.poll() is None and time.time() < deadline and not healthy:
                try:
                    healthy = httpx.get("http://127.0.0.1:8898/health", timeout=2).status_code == 200
                except httpx.TransportError:
                    time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and "Error executing job" not in text, text[-1500:]
    assert healthy or proc.returncode == 2, (proc.returncode, text[-1500:])


READ_S = 3.0  # how long a follower's read of the artifact takes here (a 70B variant's 8.6 GB: seconds or more)


def _stall_worker(rank: int, base_dir: str, art_dir: str, port: int, out: str) -> None:
    """Rank ``rank`` of a real two-rank group (gloo): rank 1 a follower whose artifact reads take
    :data:`READ_S`; rank 0 an engine that decodes a base request while a variant is loaded, recording
    when each token came."""
    import threading
    import time

    from deltafleet.serve import follower
    from deltafleet.serve.engine import Engine, SamplingParams
    from deltafleet.serve.tp import connect

    torch.set_num_threads(1)
    ctx = connect(rank, 2, "gloo", "127.0.0.1", port, 60)
    try:
        if rank == 1:
            read = follower._read
            follower._read = lambda *a: (time.sleep(READ_S), read(*a))[1]
            follower.run_follower(ctx, base_dir, "cpu", torch.float32)
            return
        engine = Engine(base_dir, art_dir, family="tiny", tp=ctx)
        try:
            times = []
            started = threading.Event()

            def decode():
                ids = engine.encode_prompt("def main(")
                for _ in engine.generate("tiny", ids, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)):
                    times.append(time.perf_counter())
                    if len(times) == 5:
                        started.set()

            t = threading.Thread(target=decode)
            t.start()
            started.wait(60)
            t0 = time.perf_counter()
            engine.get_delta("tiny-coder")  # a hot load of another variant
            load_s = time.perf_counter() - t0
            t.join(120)
            gaps = [b - a for a, b in zip(times, times[1:])]
            torch.save({"max_gap": max(gaps), "load_s": load_s, "n": len(times)}, out)
        finally:
            engine.shutdown()
    finally:
        torch.distributed.destroy_process_group()


def test_gloo_goes_on_loopback_unless_the_user_chose_an_interface(monkeypatch):
    """Found by a reviewer: gloo's sockets followed the machine's hostname. With the ranks meeting on a
    loopback address, ``connect`` names the loopback interface to gloo (``GLOO_SOCKET_IFNAME``); an
    interface the user set stays, and a rendezvous elsewhere is left to gloo."""
    import os
    import sys

    from deltafleet.serve.tp import gloo_on_loopback, loopback_interface

    assert loopback_interface() == ("lo" if sys.platform == "linux" else "lo0")
    for host in ("127.0.0.1", "::1", "localhost"):
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # (empty: unset, as gloo reads it)
        gloo_on_loopback(host)
        assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface(), host
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    gloo_on_loopback("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    gloo_on_loopback("10.1.2.3")
    assert os.environ["GLOO_SOCKET_IFNAME"] == ""


def test_gloo_sockets_stay_on_loopback_where_the_hostname_resolves_elsewhere(tmp_path):
    """Found by a reviewer: the ranks' store was on 127.0.0.1, but gloo bound and connected its sockets
    on the address the machine's hostname resolves to. Here the ranks run where the hostname is this
    machine's other address (a UTS namespace): every socket of theirs is on 127.0.0.1 all the same."""
    import ipaddress
    import json
    import os
    import socket
    import subprocess
    import sys

    psutil = pytest.importorskip("psutil")
    other = next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback), None)
    if other is None or subprocess.run(["unshare", "-r", "-u", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs an address besides loopback and unprivileged user namespaces (unshare -r -u)")
    repo = Path(__file__).resolve().parents[1]
    one_rank = '"$0" tests/scripts/gloo_sockets.py {} 9962 "$1"'  # $0: this Python, $1: where they write
    both = f"{one_rank.format(0)} & {one_rank.format(1)}; one=$?; wait $!; exit $(($? | one))"
    proc = subprocess.run(["unshare", "-r", "-u", "sh", "-c", f"hostname {other} && {both}", sys.executable,
                           str(tmp_path / "addrs")], cwd=repo, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((tmp_path / f"addrs.{rank}").read_text()) == ["127.0.0.1"], rank


def test_a_variant_load_under_tp_does_not_stall_the_requests_of_other_models(tiny_family, tmp_path):
    """Found by a reviewer: "requests for other variants are not blocked" by a load (docs/architecture.md),
    but under tensor parallelism rank 0 announced the load holding the group's lock and waited while
    every follower read the whole artifact in its only thread: every stream of every model stopped for
    the read. The followers now read when rank 0 starts its own read (``prefetch``), beside their steps,
    and rank 0 announces the load once they have it (``reading``)."""
    import torch.multiprocessing as mp

    out = tmp_path / "res"
    mp.spawn(_stall_worker, args=(str(tiny_family.base_dir), str(tiny_family.artifacts_dir), 8899, str(out)),
             nprocs=2, join=True)
    got = torch.load(out)
    assert got["load_s"] >= READ_S  # the load itself waits for the followers' read (fine)
    assert got["max_gap"] < READ_S / 2, got  # ... but the base's tokens must keep coming meanwhile

def test_a_follower_loads_the_read_it_prefetched(tiny_family, tmp_path):
    """``prefetch`` reads this rank's slice beside the steps; the load of that read takes it, even with
    the folder gone since (rank 0 read that version); ``reading`` says whether it is still read; after a
    ``drop`` the read is let go, and a load reads the folder (gone: it says why)."""
    import shutil
    import time

    from deltafleet.serve.follower import run_follower

    art = tmp_path / "coder"
    shutil.copytree(tiny_family.artifacts_dir / "coder", art)
    src, stamp = str(art), artifact_stamp(art)
    base = _follower_of(art, tmp_path / ".coder-away")

    class Polling(base):
        def recv(self):  # ("await", key): ask ("reading", key) until this rank says it has it
            cmd = super().recv() if not getattr(self, "waiting", None) else ("reading", self.waiting)
            if cmd[0] == "await":
                self.waiting = cmd[1]
                return ("reading", cmd[1])
            if cmd[0] == "reading" and self.replies and self.replies[-1] is False:
                self.waiting = None
                self.replies.pop()
                return self.recv()
            time.sleep(0.001)
            return cmd

    init = ("init", 2, 2, 64, "tiled", 4, 16, "sdpa", False)
    f = Polling([init, ("prefetch", 5, src, stamp), ("prefetch", 6, src, stamp), ("await", 5), ("await", 6),
                 ("drop", 6), ("move",), ("load", 5, src, 0, False, stamp), ("load", 6, src, 1, False, stamp),
                 ("stop",)])
    run_follower(f, str(tiny_family.base_dir), "cpu", torch.float32)
    assert [r for r in f.replies if r is not True] == [
        None, "tensor-parallel rank 1: its artifact changed or went on disk since rank 0 read it"]


def test_a_load_some_ranks_could_not_take_leaves_the_slot_free_on_every_rank(tiny_family, tmp_path, monkeypatch):
    """Found by a reviewer: with three or more ranks, a load that one follower could not take (its
    artifact changed since rank 0 read it) and another took left the slot filled on the second one,
    free on rank 0; the next load into it found it taken there and killed that rank and the server.
    Rank 0 now tells the ranks that took it to let it go, and a follower that took nothing lets go
    of nothing."""
    import shutil

    from fastapi.testclient import TestClient

    from deltafleet.serve.app import create_app
    from deltafleet.serve.engine import Engine
    from deltafleet.serve.follower import run_follower

    changed = "tensor-parallel rank 1: its artifact changed or went on disk since rank 0 read it"

    class Three(WholeRank0):  # of 3: rank 1 cannot take the load
        def _gather(self, reply):
            return [None, False, False] if self.sent[-1][0] == "reading" else [None, changed, None]

    monkeypatch.setattr("deltafleet.serve.tp.shard_delta", lambda delta, rank, world: delta)  # rank 0 holds it whole
    group = Three(3)
    engine = Engine(tiny_family.base_dir, tiny_family.artifacts_dir, family="tiny", tp=group)
    with TestClient(create_app(engine)) as tc:
        r = tc.post("/v1/completions", json={"model": "tiny-coder", "prompt": "def ", "max_tokens": 2})
        assert r.status_code == 503, r.text
        engine.shutdown()
    load = next(c for c in group.sent if c[0] == "load")
    assert group.sent[group.sent.index(load) + 1] == ("free", load[3], False)  # rank 2 gives its slot back

    art = tmp_path / "coder"
    shutil.copytree(tiny_family.artifacts_dir / "coder", art)
    src, stamp = str(art), artifact_stamp(art)
    init = ("init", 1, 2, 64, "tiled", 4, 16, "sdpa", False)
    for first, replies in ((stamp, [None, None]), (("an older version",), [changed, None])):  # rank 2, rank 1
        f = _follower_of(art, tmp_path / ".coder-away")(
            [init, ("load", 1, src, 0, False, first), ("free", 0, False), ("load", 2, src, 0, False, stamp), ("stop",)])
        run_follower(f, str(tiny_family.base_dir), "cpu", torch.float32)
        assert f.replies == replies
