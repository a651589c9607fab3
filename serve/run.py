"""Serve the base and every BitDelta artifact found, OpenAI-compatible (``make serve``).

    python serve/run.py                              # http://127.0.0.1:8000/v1, models tiny, tiny-<variant>...
    python serve/run.py port=8001 paths.root=/scratch/df
    python serve/run.py device=cuda dtype=bfloat16 tp=2   # tensor parallel over 2 GPUs, one process each
    python serve/run.py device=cuda dtype=bfloat16 tp=2 delta_cache.device_slots=14 \
        'synthetic={shape: {vocab_size: 32000, hidden_size: 8192, intermediate_size: 28672, num_hidden_layers: 80,
                    num_attention_heads: 64, num_key_value_heads: 8, max_position_embeddings: 1024}, variants: 14}'
                                                     # a 70B-shaped family of 14 variants generated on the GPUs
    curl -s 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny-coder", "prompt": "def ", "max_tokens": 32, "temperature": 0}'

Composes ``conf/serve.yaml``, loads the base from ``base_dir`` (Hugging Face checkpoint +
tokenizer), lists ``<artifacts_dir>/*/bitdelta.json`` as ``<family>-<variant>`` (each loaded on its
first request) and runs uvicorn on ``host:port``. With ``tp=N > 1`` it starts N processes
(``torch.distributed``: NCCL on GPUs, gloo on the CPU, rendezvous on 127.0.0.1:``tp_port``); rank 0
serves HTTP and schedules, the others hold their slices of the base and the deltas (serve/tp.py).
A rank that dies, or does not answer a collective within ``tp_timeout_s``, fails the group: the
requests it held up fail, the server stops, and the launcher names the rank on one line and exits
with :data:`GROUP_FAILED` (:func:`_join_ranks`).
With ``synthetic`` set, nothing is read: the base and the variants are generated on the device by
every rank, its own slice (serve/synthetic.py), and every variant is put in its slot before the
server answers.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, ListConfig, OmegaConf

from deltafleet.values import real as _number
from deltafleet.values import whole as _integer


def _cache_options(cfg: DictConfig) -> dict:
    dc = cfg.delta_cache
    return {"device_slots": dc.device_slots,
            "device_budget_bytes": None if dc.device_budget_gb is None else int(dc.device_budget_gb * 1e9),
            "host_budget_bytes": None if dc.host_budget_gb is None else int(dc.host_budget_gb * 1e9),
            "pinned": list(dc.pinned or []), "pin_top_n": dc.pin_top_n, "half_life_s": dc.half_life_s,
            "wait_timeout_s": dc.wait_timeout_s, "sign_layout": dc.get("sign_layout", "tiled")}


def _threads(cfg: DictConfig, world: int = 1) -> int:
    """``threads`` (checked as every job's: deltafleet/threads.py), else the cores less one per rank.

    Raises:
        ValueError: ``threads`` is neither null nor a positive integer.
    """
    from deltafleet.threads import check_threads

    check_threads(cfg.get("threads"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # Leave a core to the HTTP event loop: on a busy CPU, intra-op threads spinning at every op's
    # barrier starve it, and a one-token decode step gains nothing from them (10-20x slower on 2 cores).
    return cfg.threads or max(1, (cores - 1) // world)


def _check_port(host: str, port: int, key: str = "port") -> int:
    """The port to serve on: ``port``, or for 0 a free one the OS picks (so the address printed is
    the one served). Raises ValueError if ``host:port`` cannot be bound (in use, or not an address
    of this machine), checked before the model loads, so the failure comes first and alone; ``key``:
    the setting to change. Bound as uvicorn binds it (``SO_REUSEADDR``, so a socket in TIME_WAIT does
    not count)."""
    import socket

    family = socket.AF_INET6 if ":" in str(host) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port} ({e.strerror or e}): choose another {key}=N"
                             + (" or host=..." if key == "port" else "")) from None
        return sock.getsockname()[1]


def _url(host: str, port: int) -> str:
    """The base URL announced at start, ``http://host:port/v1``, with an IPv6 literal in brackets
    (RFC 3986: ``http://[::1]:8000/v1``; bare, its colons would read as the port's). A host with a
    colon is an IPv6 literal, as :func:`_check_port` takes it: a name or an IPv4 address has none."""
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


CORS_KEYS = ("allow_origins", "allow_methods", "allow_headers", "allow_credentials")
SECTIONS = ("kv_cache", "delta_cache")  # conf/serve.yaml's own groups of settings, checked key by key


def _check_cors(cfg: DictConfig) -> None:
    """Raises ValueError unless ``cors`` is null or a mapping of :data:`CORS_KEYS` (lists of strings,
    and a bool for ``allow_credentials``)."""
    cors = cfg.get("cors")
    if cors is None:
        return
    c = OmegaConf.to_container(cors) if isinstance(cors, DictConfig) else cors
    if not isinstance(c, dict) or set(c) - set(CORS_KEYS):
        raise ValueError(f"cors must be null or a mapping of {', '.join(CORS_KEYS)}, got {c!r}")
    for key, value in c.items():
        ok = isinstance(value, bool) if key == "allow_credentials" else (
            isinstance(value, list) and all(isinstance(v, str) for v in value))
        if not ok:
            raise ValueError(f"cors.{key} must be {'true or false' if key == 'allow_credentials' else 'a list of strings'}, "
                             f"got {value!r}")


def _check_timeouts(cfg: DictConfig) -> None:
    """Raises ValueError unless ``timeout_request_s`` and ``timeout_graceful_shutdown_s`` are null (none)
    or finite and > 0, and ``timeout_keep_alive_s`` finite and > 0."""
    for key, nullable in (("timeout_request_s", True), ("timeout_keep_alive_s", False),
                          ("timeout_graceful_shutdown_s", True)):
        value = cfg[key]
        if value is None and nullable:
            continue
        if not _number(value) or not value > 0:
            raise ValueError(f"{key} must be a finite number of seconds > 0{' or null (none)' if nullable else ''}, "
                             f"got {value!r}")


FLAGS = ("force", "async_scheduling", "late_planning", "cuda_graphs", "prefill_graphs", "capture_at_start")
COUNTS = ("max_batch", "max_num_batched_tokens", "tp")  # integers ≥ 1
LIMITS = ("max_waiting", "max_request_bytes", "max_pending_body_bytes", "delta_cache.device_slots")  # or null
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def check_settings(cfg: DictConfig) -> None:
    """Check conf/serve.yaml's settings once, before anything loads or any rank starts, so that a bad
    value stops the server with its key named instead of failing later inside a part (or, for a flag
    such as ``force=no``, being read as true): flags are true or false; counts, ports and byte limits
    integers in range; durations and budgets numbers (a half-life may be infinite); ``device`` cpu,
    cuda or cuda:N, with a CUDA device present for the latter; ``log_level`` one of uvicorn's;
    ``family``, the base's model id and its variants' prefix (``<family>-<variant>``), of a variant
    name's characters (no ``/``: ``/v1/models/{id}`` must find it); ``attention`` and
    ``delta_cache.sign_layout`` one of theirs. The parts still check what only they can (the dtype,
    the KV cache's options, the synthetic family's).

    Raises:
        ValueError: the first setting that is not of its kind, by name.
    """
    from deltafleet.serve.request import VARIANT_NAME

    _check_keys(cfg)
    for key in FLAGS:
        if not isinstance(v := cfg.get(key), bool):
            raise ValueError(f"{key} must be true or false, got {v!r}")
    for key in COUNTS:
        if not _integer(v := OmegaConf.select(cfg, key)) or v < 1:
            raise ValueError(f"{key} must be an integer ≥ 1, got {v!r}")
    for key in LIMITS:
        if (v := OmegaConf.select(cfg, key)) is not None and (not _integer(v) or v < 1):
            raise ValueError(f"{key} must be null or an integer ≥ 1, got {v!r}")
    if cfg.max_pending_body_bytes is not None and cfg.max_pending_body_bytes < (cfg.max_request_bytes or 0):
        # a body between the two would wait for room it can never have (503 with Retry-After, every try)
        raise ValueError(f"max_pending_body_bytes ({cfg.max_pending_body_bytes}) must be at least max_request_bytes "
                         f"({cfg.max_request_bytes}), the largest body one request may send")
    if not _integer(v := cfg.long_prefill_token_threshold) or v < 0:
        raise ValueError(f"long_prefill_token_threshold must be an integer ≥ 0, got {v!r}")
    if not _integer(v := cfg.port) or not 0 <= v <= 65535:  # 0: any free port, as the OS picks it
        raise ValueError(f"port must be a port number from 0 to 65535, got {v!r}")
    if not _integer(v := cfg.tp_port) or not 1 <= v <= 65535:  # every rank must know it: no 0
        raise ValueError(f"tp_port must be a port number from 1 to 65535, got {v!r}")
    if not _number(v := cfg.tp_timeout_s) or not v > 0:
        raise ValueError(f"tp_timeout_s must be a number of seconds > 0, got {v!r}")
    if not isinstance(cfg.host, str) or not cfg.host:
        raise ValueError(f"host must be an address of this machine, got {cfg.host!r}")
    if not isinstance(cfg.family, str) or not re.fullmatch(VARIANT_NAME, cfg.family):
        raise ValueError("family (the base's model id; variants are <family>-<variant>) must be 1–64 letters, "
                         f"digits, '.', '_' or '-', starting with a letter or digit, got {cfg.family!r}")
    dc = cfg.delta_cache
    hl = dc.half_life_s  # inf: request counts that never decay
    if isinstance(hl, bool) or not isinstance(hl, (int, float)) or not hl > 0:
        raise ValueError(f"delta_cache.half_life_s must be a number > 0, got {hl!r}")
    if dc.device_budget_gb is not None and (not _number(dc.device_budget_gb) or not dc.device_budget_gb > 0):
        raise ValueError(f"delta_cache.device_budget_gb must be a number > 0 or null, got {dc.device_budget_gb!r}")
    for key, v, nullable in (("wait_timeout_s", dc.wait_timeout_s, False), ("host_budget_gb", dc.host_budget_gb, True)):
        if (v is not None or not nullable) and (not _number(v) or v < 0):
            raise ValueError(f"delta_cache.{key} must be a number ≥ 0{' or null' if nullable else ''}, got {v!r}")
    if not _integer(dc.pin_top_n) or dc.pin_top_n < 0:
        raise ValueError(f"delta_cache.pin_top_n must be an integer ≥ 0, got {dc.pin_top_n!r}")
    pinned = dc.pinned if dc.pinned is not None else []
    if not isinstance(pinned, (list, ListConfig)) or not all(isinstance(p, str) and p for p in pinned):
        raise ValueError(f"delta_cache.pinned must be a list of variant names, got {pinned!r}")
    if cfg.log_level not in LOG_LEVELS and not _integer(cfg.log_level):  # uvicorn takes logging's numbers too
        raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)} (or a number), got {cfg.log_level!r}")
    if cfg.api_key is not None and not isinstance(cfg.api_key, str):
        raise ValueError(f"api_key must be a string or null, got {cfg.api_key!r}")
    from deltafleet.serve.attention import BACKENDS
    from deltafleet.serve.batch import check_sign_layout

    if cfg.attention not in BACKENDS:
        raise ValueError(f"attention must be one of {', '.join(BACKENDS)}, got {cfg.attention!r}")
    check_sign_layout(dc.get("sign_layout", "tiled"), "delta_cache.sign_layout")
    _check_device(cfg.device)
    _check_timeouts(cfg)
    _check_cors(cfg)
    _switch_interval(cfg)


def _check_keys(cfg: DictConfig) -> None:
    """``deltafleet.cli.check_settings`` of conf/serve.yaml, :data:`SECTIONS` checked key by key."""
    from deltafleet.cli import check_settings

    check_settings(cfg, "serve.yaml", SECTIONS)

def _no_base(cfg: DictConfig) -> str:
    from deltafleet.cli import build_hint

    return (f"no base checkpoint at {cfg.base_dir} (config.json missing): build it with "
            f"`{build_hint(cfg, 'base')}`, or set base_dir=/path/to/hf/checkpoint")


def check_tensor_parallel(cfg: DictConfig) -> None:
    """With ``tp`` > 1, before any rank starts: the base checkpoint is there and its heads split over
    the ranks, and the HTTP port and the ranks' rendezvous port (``tp_port``, on 127.0.0.1) are two
    different free ports.
    The ranks check the rest of the shapes.

    Raises:
        ValueError: naming the setting.
    """
    from deltafleet.serve.model import ModelArgs
    from deltafleet.serve.tp import heads_split

    config = Path(cfg.base_dir) / "config.json"
    if not config.is_file():  # every rank would fail to load it
        raise ValueError(_no_base(cfg))
    try:
        args = ModelArgs.from_hf_config(json.loads(config.read_text()))
    except NotImplementedError as e:  # an architecture not served: every rank would fail on it
        raise ValueError(f"{config}: {e}") from None
    if str(cfg.get("device", "cpu")).startswith("cuda"):  # one process a GPU, rank r on cuda:r
        import torch

        if cfg.device != "cuda":
            raise ValueError(f"device={cfg.device} with tp={cfg.tp}: tensor parallelism puts rank r on cuda:r; "
                             "use device=cuda (and CUDA_VISIBLE_DEVICES to choose the GPUs)")
        if cfg.tp > torch.cuda.device_count():
            raise ValueError(f"tp={cfg.tp} needs {cfg.tp} GPUs, one a rank; there are {torch.cuda.device_count()}")
    if not heads_split(args, cfg.tp):
        raise ValueError(f"tp={cfg.tp} does not split the base's {args.n_head} query / {args.n_local_heads} "
                         "key-value heads: choose a tp that divides both")
    if cfg.port == cfg.tp_port:  # each free alone, but rank 0 takes tp_port before the server binds port
        raise ValueError(f"tp_port ({cfg.tp_port}, the ranks' rendezvous) must differ from port, the server's")
    if cfg.port:  # 0: rank 0 picks one
        _check_port(cfg.host, cfg.port)
    _check_port("127.0.0.1", cfg.tp_port, "tp_port")


def _check_device(device) -> None:
    """Raises ValueError unless ``device`` is cpu, cuda or cuda:N, with that CUDA device present."""
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    if device.startswith("cuda"):
        import torch

        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available():
            raise ValueError(f"device={device}, but torch {torch.__version__} sees no CUDA device: "
                             "serve on device=cpu, or install a CUDA build of torch")
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={device}, but there are {torch.cuda.device_count()} CUDA devices")


def _switch_interval(cfg: DictConfig) -> float:
    """``gil_switch_interval_ms`` in seconds, for ``sys.setswitchinterval``. The model thread gives the
    GIL up in every torch call (PyTorch's bindings release it around each operator), and while the
    HTTP or detokenizer thread runs Python it waits up to the interval to get it back: one interval
    per call, dozens of calls a step (Python's default, 5 ms, is a decode step's length per call).

    Raises:
        ValueError: it is not a finite number > 0.
    """
    value = cfg.get("gil_switch_interval_ms", 0.1)
    if not _number(value) or not value > 0:
        raise ValueError(f"gil_switch_interval_ms must be a finite number of milliseconds > 0, got {value!r}")
    return value / 1000


ANSWER_S = 5.0  # past timeout_graceful_shutdown_s: the requests it cuts off get their 503 in this time


def _draining_server(config, drain, announce, failed=lambda: False):
    """uvicorn's server, which calls ``announce()`` once it listens, and on the first SIGTERM, SIGHUP
    (unless ignored) or Ctrl-C also calls ``drain()`` (``app.state.drain``: the requests not started
    are refused at once, the running ones cut off at the grace's end), in a thread of its own: the
    signal may come while this thread holds the scheduler's lock. Its ``run`` returns after a signal
    (status 0), rather than dying of it as ``uvicorn.run`` does; a second Ctrl-C ends the process at
    once with status 130.
    Once ``failed()`` (checked every tick, a tenth of a second: the engine cannot generate any more)
    it shuts down as on a signal."""
    import contextlib
    import threading

    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                announce()

        async def on_tick(self, counter: int) -> bool:
            if not self.should_exit and failed():
                self.should_exit = True
                threading.Thread(target=drain, name="drain", daemon=True).start()
            return await super().on_tick(counter)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn's (SIGINT, SIGTERM), and SIGHUP, a closed terminal's, as SIGTERM, unless it is
            ignored (``nohup``: the server goes on)."""
            hup = getattr(signal, "SIGHUP", None)
            take = (hup is not None and threading.current_thread() is threading.main_thread()
                    and signal.getsignal(hup) is signal.SIG_DFL)
            if take:
                signal.signal(hup, self.handle_exit)
            try:
                with super().capture_signals():
                    yield
            finally:
                if take:
                    signal.signal(hup, signal.SIG_DFL)

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C: out at once, as uvicorn's
                # force_exit would, but before the event loop cancels the requests' tasks (a traceback
                # each) and the interpreter exits under the model thread's step (SIGABRT); with tp > 1
                # the launcher stops the other ranks
                _exit(130)
            if not self.should_exit:
                threading.Thread(target=drain, name="drain", daemon=True).start()
            super().handle_exit(sig, frame)
            # uvicorn raises the signal again once it has shut down, which would kill the process
            # before its own cleanup (a tensor-parallel server's other ranks): it returns instead
            getattr(self, "_captured_signals", []).clear()

    return DrainingServer(config)


def _serve(cfg: DictConfig, device: str, tp=None) -> None:
    import torch
    import uvicorn

    from deltafleet.serve.app import create_app, http_protocol
    from deltafleet.serve.engine import Engine
    from deltafleet.serve.request import EngineFailedError, TensorParallelError

    try:
        torch.set_num_threads(_threads(cfg, 1 if tp is None else tp.world))
        sys.setswitchinterval(_switch_interval(cfg))
        port = _check_port(cfg.host, cfg.port)
        protocol = http_protocol(cfg.timeout_request_s, cfg.get("http_parser", "auto"))
        if not (Path(cfg.base_dir) / "config.json").is_file():
            raise FileNotFoundError(_no_base(cfg))
        engine = Engine(cfg.base_dir, cfg.artifacts_dir, family=cfg.family, device=device, dtype=cfg.dtype,
                        force=cfg.force, delta_cache=_cache_options(cfg), max_batch=cfg.max_batch, tp=tp,
                        cuda_graphs=cfg.cuda_graphs, prefill_graphs=cfg.prefill_graphs,
                        capture_at_start=cfg.capture_at_start,
                        max_num_batched_tokens=cfg.max_num_batched_tokens,
                        kv_cache=OmegaConf.to_container(cfg.kv_cache), attention=cfg.attention,
                        scheduler_delay_factor=cfg.scheduler_delay_factor, async_scheduling=cfg.async_scheduling,
                        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                        late_planning=cfg.late_planning)
    except TensorParallelError:  # a rank died or stopped answering while the others started (logged)
        _exit(GROUP_FAILED)
    except (FileNotFoundError, ValueError, NotImplementedError) as e:  # no base; a dtype or architecture not served
        from deltafleet.cli import drop_refused_run_dir

        drop_refused_run_dir()  # a rank of tp > 1 runs outside Hydra: nothing
        print(f"error: {e}", file=sys.stderr)
        if tp is not None:
            # No ("stop",) to the other ranks: they may be in a collective of their own start (a synthetic
            # base checks its replicas), where a broadcast would wait for them forever. Exit at once
            # instead: the others fail on the connections this closes, and the launcher, seeing this
            # rank's status, stops them and exits with it (_join_ranks).
            _exit(2)
        sys.exit(2)
    try:
        if engine.synthetic is not None:
            try:
                _preload(engine)
            except EngineFailedError:  # as above
                _exit(GROUP_FAILED)
        url = _url(cfg.host, port)
        ids = [m.id for m in engine.models()]
        where = f"{engine.device}" if tp is None else f"{tp.world} ranks, tensor parallel"
        line = (f"serving {', '.join(ids)} ({where}, {cfg.dtype}, context {engine.max_model_len}, "
                f"{torch.get_num_threads()} threads) at {url}")
        api_key = cfg.api_key if cfg.api_key not in (None, "") else os.environ.get("DELTAFLEET_API_KEY") or None
        app = create_app(engine, max_waiting=cfg.max_waiting, api_key=api_key, max_request_bytes=cfg.max_request_bytes,
                         request_timeout_s=cfg.timeout_request_s, max_pending_body_bytes=cfg.max_pending_body_bytes,
                         cors=OmegaConf.to_container(cfg.cors) if cfg.cors is not None else None)
        grace = cfg.timeout_graceful_shutdown_s
        config = uvicorn.Config(app, host=cfg.host, port=port, log_level=cfg.log_level, http=protocol,
                                timeout_keep_alive=cfg.timeout_keep_alive_s, lifespan="off",
                                timeout_graceful_shutdown=None if grace is None else grace + ANSWER_S)
        server = _draining_server(config, lambda: app.state.drain(grace), lambda: print(line, flush=True),
                                  lambda: engine.failure() is not None)
        server.run()
        if not server.started:
            sys.exit(3)  # uvicorn's STARTUP_FAILURE (it logged why)
    finally:
        engine.shutdown()
    if engine.failure() is not None:  # the tensor-parallel group failed (logged): the launcher names the rank
        _exit(GROUP_FAILED)
    if not engine.scheduler.idle:  # past the grace: the model thread may be inside a step, which the
        # interpreter's exit would abort (SIGABRT); the other ranks are stopped already
        _exit(0)
    _leave_busy_threads(ANSWER_S)


def _leave_busy_threads(wait_s: float) -> None:
    """Give the threads a request left running (a tokenizer call or a grammar compile in a worker
    thread, which the interpreter's exit would wait for without limit) ``wait_s`` seconds in all to
    end; past that, name them on stderr and end the process with status 0, as the shutdown itself
    succeeded."""
    import threading
    import time

    me, end = threading.current_thread(), time.monotonic() + wait_s
    for t in threading.enumerate():
        if t is not me and not t.daemon:
            t.join(max(0.0, end - time.monotonic()))
    busy = sorted({t.name for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()})
    if busy:
        print(f"warning: threads still busy {wait_s:g} s after the server stopped ({', '.join(busy)}): "
              f"exiting without them", file=sys.stderr)
        _exit(0)


def _exit(status: int) -> None:
    """End this process now with ``status``, its output flushed: without the interpreter's exit, which
    would wait for (or abort) a model thread inside a step, or tear down a failed process group."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _preload(engine) -> None:
    """Generate the variants of a synthetic family into their device slots now (in order, as many as
    there are slots), so the memory is all taken before the first request."""
    import time

    import torch

    t0 = time.perf_counter()
    cards = engine.models()[1:1 + engine.slots.n_slots]  # more would evict these (or find pinned slots)
    for card in cards:
        engine.get_delta(card.id, request=False)  # ahead of traffic: no request
    cuda = engine.device.type == "cuda"
    mem = f"; {torch.cuda.memory_allocated(engine.device) / 2**30:.1f} GiB allocated on {engine.device}" if cuda else ""
    print(f"synthetic family: {len(cards)} variants generated into {engine.slots.n_slots} slots "
          f"in {time.perf_counter() - t0:.1f} s{mem}", flush=True)


def _write_synthetic(cfg: DictConfig) -> None:
    """``synthetic`` set: write the family's folder (config.json, tokenizer, synthetic.json; no weights)
    into the run's folder and serve it as ``base_dir``, without ``artifacts_dir``. Without
    ``synthetic.tokenizer_dir``, the serve benchmark's tokenizer (serve/bench.py) is built once under
    ``<paths.output_dir>/synthetic/``.

    Raises:
        ValueError: bad ``synthetic`` options (serve/synthetic.py, ``check_options``).
    """
    from hydra.core.hydra_config import HydraConfig

    from deltafleet.atomic import staged_dir
    from deltafleet.serve.synthetic import check_options, write_base_dir

    syn = cfg.synthetic
    opts = check_options(OmegaConf.to_container(syn, resolve=True) if isinstance(syn, DictConfig) else syn)
    tok = opts["tokenizer_dir"]
    if tok is None:
        from deltafleet.serve.bench import stdlib_tokenizer

        vocab = int(opts["shape"]["vocab_size"])
        tok = Path(cfg.paths.output_dir) / "synthetic" / f"tokenizer-stdlib-{vocab}"
        if not (tok / "tokenizer.json").is_file():
            with staged_dir(tok) as tmp:
                stdlib_tokenizer(tmp, vocab, int(opts["shape"].get("max_position_embeddings", 2048)))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    cfg.base_dir = str(write_base_dir(run_dir / "synthetic-base", opts, tok))
    cfg.artifacts_dir = None


def _rank_main(rank: int, cfg_dict: dict) -> None:
    """One process of a tensor-parallel server (``torch.multiprocessing.spawn``)."""
    import torch
    import torch.distributed as dist

    from deltafleet.serve.engine import DTYPES
    from deltafleet.serve.follower import run_follower
    from deltafleet.serve.tp import connect

    os.setpgrp()  # signals reach the launcher alone, which passes them to rank 0 (main)
    cfg = OmegaConf.create(cfg_dict)
    cuda = cfg.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    ctx = connect(rank, cfg.tp, "nccl" if cuda else "gloo", "127.0.0.1", cfg.tp_port, cfg.tp_timeout_s)
    device = f"cuda:{rank}" if cuda else cfg.device
    try:
        if rank == 0:
            _serve(cfg, device, ctx)
        else:
            torch.set_num_threads(_threads(cfg, cfg.tp))
            run_follower(ctx, cfg.base_dir, device, DTYPES[cfg.dtype])
    finally:
        dist.destroy_process_group()


STOP_WAIT_S = 10.0  # how long the launcher waits for the other ranks once rank 0 has ended
# how long it waits for rank 0 once another rank failed: long enough for rank 0 to reach the same start
# error (a missing or mismatched checkpoint fails every rank) and print its line; and for the other
# ranks once rank 0 ended on its group's failure, to end on their own before they are killed
ERROR_WAIT_S = 3.0
# rank 0's exit status, and the launcher's, when the tensor-parallel group failed: a rank died, or did
# not answer a collective within tp_timeout_s (serve/tp.py)
GROUP_FAILED = 4


def _signal_rank0(ranks, sig: int) -> None:
    try:
        os.kill(ranks.processes[0].pid, sig)
    except ProcessLookupError:
        pass


def _end(procs: list, wait_s: float, sig: int | None = None) -> list:
    """Send ``sig`` (if any) to each process of ``procs`` still running, give them ``wait_s`` seconds
    in all to end, then kill those left with SIGKILL (a stopped process takes no other signal).
    Returns the processes killed; every one of ``procs`` has ended when it returns."""
    import time

    for p in procs:
        if sig is not None and p.is_alive():
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    killed = [p for p in procs if p.is_alive()]
    for p in killed:
        p.kill()
    for p in killed:
        p.join()
    return killed


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _group_failure(procs: list, codes: list, signals: list[int], timeout_s: float | None) -> str | None:
    """The line that names the rank which failed the tensor-parallel group, from ``codes`` (each
    rank's exit status, None while it runs, read once), after ending every rank; None if it has not
    failed. It has when a rank died of a signal the launcher did not pass on (SIGKILL, a native
    crash): rank 0 is then stopped as a signal stops it, with :data:`STOP_WAIT_S` to shut down (the
    requests it runs fail at once on the rank gone); or when rank 0 ended with :data:`GROUP_FAILED`
    (it logged why): the ranks that have not ended :data:`ERROR_WAIT_S` later do not answer
    (stopped, hung), and are killed."""
    died = [i for i, c in enumerate(codes) if c is not None and c < 0 and not (i == 0 and signals)]
    if died:
        i = died[0]
        if procs[0].is_alive():
            _end(procs[:1], STOP_WAIT_S, signal.SIGTERM)
        _end(procs, ERROR_WAIT_S)
        return f"tensor-parallel rank {i} (pid {procs[i].pid}) died of {_signal_name(-codes[i])}: the server stopped"
    if codes[0] != GROUP_FAILED:
        return None
    killed = _end(procs[1:], ERROR_WAIT_S)
    if killed:
        within = "in time" if timeout_s is None else f"within tp_timeout_s={timeout_s:g} s"
        names = ", ".join(f"{procs.index(p)} (pid {p.pid})" for p in killed)
        return (f"tensor-parallel rank{'s' if len(killed) > 1 else ''} {names} did not answer {within} (stopped or "
                "hung) and was killed: the server stopped")
    died = [i for i, p in enumerate(procs) if i and p.exitcode < 0]  # on its own, since the codes were read
    if died:
        i = died[0]
        return (f"tensor-parallel rank {i} (pid {procs[i].pid}) died of {_signal_name(-procs[i].exitcode)}: "
                "the server stopped")
    return "the tensor-parallel group failed (rank 0's line above says how): the server stopped"


def _join_ranks(ranks, signals: list[int], stop_after_s: float | None = None, timeout_s: float | None = None) -> int:
    """Wait for the tensor-parallel ranks (``torch.multiprocessing``'s ProcessContext) and return the
    launcher's exit status: 0, a rank's own error status (2; 3 where uvicorn could not bind; 130 after
    a second Ctrl-C), or 128 + the signal the launcher passed on, where rank 0 ended on it before it
    could shut down gracefully (during startup, say). Rank 0 stops the others as it ends
    (``Engine.shutdown``); one it could not stop is terminated after :data:`STOP_WAIT_S`, and killed
    if it does not end then, not waited for in a collective. When a rank fails, the others get
    :data:`ERROR_WAIT_S` to end on their own before the join stops them (its ``grace_period``), and
    rank 0's error status is the one reported: it may have failed on the same thing, or the others on
    its closed connections. A rank that raised (status 1, a traceback of its own) is a bug: torch's
    exception is raised.

    When the group fails while it serves — a rank dies of a signal, or rank 0 ends with
    :data:`GROUP_FAILED` (a rank did not answer within ``timeout_s``, ``tp_timeout_s``) — every rank is
    ended, one line names the rank, and the status is :data:`GROUP_FAILED` (:func:`_group_failure`).

    ``stop_after_s``: once a signal has been passed on, how long rank 0 has to end (its grace and the
    others' stop) before every rank is killed, with status 128 + the signal; None: no limit. Each
    round decides from the ranks' statuses read once."""
    import time
    from multiprocessing.connection import wait

    import torch.multiprocessing as mp

    procs = ranks.processes
    first = procs[0]
    ended = signalled = None
    while True:
        wait([p.sentinel for p in procs if p.exitcode is None], timeout=0.5)
        codes = [p.exitcode for p in procs]
        if all(c == 0 for c in codes):
            return 0
        failure = _group_failure(procs, codes, signals, timeout_s)
        if failure is not None:
            print(f"error: {failure}", file=sys.stderr, flush=True)
            return GROUP_FAILED
        if any(c not in (None, 0) for c in codes):  # a rank's own error: the join stops the others and raises
            try:
                ranks.join(timeout=0, grace_period=ERROR_WAIT_S)
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
                for code in (first.exitcode, getattr(e, "exit_code", None)):  # no traceback for these
                    if code in (2, 3, 130):
                        return code
                if signals:
                    return 128 + signals[0]
                raise
        now = time.monotonic()
        if signals and stop_after_s is not None and first.is_alive():
            signalled = signalled or now
            if now - signalled > stop_after_s:
                print(f"error: tensor-parallel rank 0 (pid {first.pid}) did not shut down within {stop_after_s:g} s "
                      f"of {_signal_name(signals[0])}: every rank was killed", file=sys.stderr, flush=True)
                _end(procs, 0.0)
                return 128 + signals[0]
        if not first.is_alive():
            ended = ended or now
            if now - ended > STOP_WAIT_S:
                _end(procs, STOP_WAIT_S, signal.SIGTERM)
                return 128 + signals[0] if signals else 1


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    from deltafleet.cli import refuse

    try:
        check_settings(cfg)
    except ValueError as e:
        refuse(e)
    if cfg.synthetic is not None:  # {} too: refused for want of a shape, not taken for null
        try:
            _write_synthetic(cfg)
        except (OSError, ValueError) as e:
            refuse(e)
    if cfg.tp > 1:
        import torch.multiprocessing as mp

        try:
            check_tensor_parallel(cfg)
        except ValueError as e:
            refuse(e)
        # once a rank stops on its error line, the launcher stops the others with a warning each: not news
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        signals: list[int] = []
        ranks = None

        def forward(sig, frame):  # the ranks have process groups of their own: a terminal's Ctrl-C comes here
            signals.append(sig)
            if ranks is not None:
                _signal_rank0(ranks, sig)  # rank 0 shuts the server down and stops the others

        signal.signal(signal.SIGINT, forward)
        signal.signal(signal.SIGTERM, forward)
        if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:  # ignored (nohup): so it stays, in the ranks too
            signal.signal(signal.SIGHUP, forward)
        ranks = mp.spawn(_rank_main, args=(OmegaConf.to_container(cfg, resolve=True),), nprocs=cfg.tp, join=False)
        for sig in signals[:2]:  # those that came while the ranks were being started
            _signal_rank0(ranks, sig)
        grace = cfg.timeout_graceful_shutdown_s
        sys.exit(_join_ranks(ranks, signals, None if grace is None else grace + ANSWER_S + STOP_WAIT_S,
                             cfg.tp_timeout_s))
    else:
        try:
            _serve(cfg, cfg.device)
        except KeyboardInterrupt:  # a Ctrl-C before the server listens (loading): no traceback
            sys.exit(130)


if __name__ == "__main__":
    from deltafleet.cli import run_script

    run_script(main)
