"""Real text for every domain, prepared offline: ``python -m train.data`` (``make data``).

Writes ``<data_dir>/<domain>/{train,val,test}.jsonl``, one ``{"text": str, "source": str}`` object
per line, and ``<data_dir>/manifest.json`` (counts, file hashes, the config used). Every source is
already on the machine or comes from a Debian package, so nothing is downloaded here:

- ``coder``:  Python source of this interpreter's standard library (tests and idlelib excluded).
- ``math``:   arithmetic and word problems from ``random.Random(seed)``, each answer checked by a
  second, independent route (exact ``Fraction`` evaluation of an ``ast``) before it is kept, and
  each question kept once (so no problem is in two splits).
  Format: ``Question: What is 347 + 85?\\nAnswer: 432``; the answer is always one integer.
- ``writer``: Jane Austen's six novels (Debian ``r-cran-janeaustenr``, public domain).
- ``legal``:  licence texts: ``/usr/share/common-licenses`` and ``/usr/share/doc/*/copyright``.
- ``chat``:   instruction-following conversations, ``{"messages": [{"role", "content"}, …],
  "source"}`` (rendered by each model's own chat template when it is tokenised,
  ``deltafleet.train.datamodule``), made from the sources above: write a standard-library function
  from its signature and docstring, explain one, answer a math problem, continue an Austen passage.
- ``general``: the base's mix, ``general_fraction`` of every text domain's documents per split
  (not ``chat``).

Units, caps and splits. ``source`` names a *unit*: a stdlib file (``stdlib:json/decoder.py``), a
chapter (``austen:emma#12``), a licence file (``license:/usr/share/common-licenses/GPL-3``), a block
of problems (``math:gen#123``). A unit longer than ``chunk_chars`` becomes several documents, cut at
line boundaries (preferring blank lines, i.e. paragraph or block ends); all documents of a unit
share its source and its split, so neighbouring chunks never straddle train and test. The cap
``max_chars.<domain>`` keeps whole units, taken in the order of a salted sha256 of their source: a
uniform, deterministic sample rather than "the first files alphabetically". The split ranks the kept
units by a second, independently salted sha256: the first ``round(n * val_fraction)`` go to val,
the next ``round(n * test_fraction)`` to test (at least one each), the rest to train. A chat
conversation made from a stdlib file or an Austen chapter that the coder or writer domain keeps
takes that unit's split there (:data:`CHAT_TEXT_SOURCES`), so no conversation in chat's val or test
comes from text that a variant or the base's general mix trains on. Nothing depends on Python's
``hash`` or on directory listing order, so two runs write identical bytes.
"""
from __future__ import annotations

import ast
import bz2
import gzip
import hashlib
import json
import logging
import lzma
import math
import operator
import os
import random
import re
import sys
import sysconfig
import time
import warnings
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from deltafleet.atomic import write_bytes

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
TEXT_DOMAINS = ("coder", "math", "writer", "legal")
CHAT_DOMAINS = ("chat",)   # records hold "messages", not "text"
VARIANT_DOMAINS = TEXT_DOMAINS + CHAT_DOMAINS
DOMAINS = ("general",) + VARIANT_DOMAINS
# the text domains whose sources the chat domain's conversations are made from: a conversation takes
# the split of its file or chapter there, so none in chat val/test is made from text another domain
# (or the base's general mix) trains on
CHAT_TEXT_SOURCES = ("coder", "writer")
CHAT_MAX_FUNCTION_LINES = 30
CHAT_PASSAGES_PER_CHAPTER = 2
AUSTEN_TITLES = {"emma": "Emma", "mansfieldpark": "Mansfield Park", "northangerabbey": "Northanger Abbey",
                 "persuasion": "Persuasion", "prideprejudice": "Pride and Prejudice",
                 "sensesensibility": "Sense and Sensibility"}
MIN_DOCS_PER_SPLIT = 3       # fewer documents than this in any split is an error, not a warning
PROBLEMS_PER_DOC = 8
MANIFEST_VERSION = 1

# Standard-library folders that are tests, GUI tooling, installed third-party code or generated
# tables (codec maps, pydoc's topic dump) rather than hand-written Python.
STDLIB_SKIP_DIRS = frozenset({
    "test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__",
    "lib2to3/tests", "pydoc_data", "encodings", "ensurepip/_bundled",
})
AUSTEN_DEFAULT_DIRS = (Path("/usr/lib/R/site-library/janeaustenr"),)
AUSTEN_UNPACKED = Path("sources/janeaustenr/usr/lib/R/site-library/janeaustenr")  # under data_dir
LICENSE_NAME = re.compile(r"^(copyright|licen[cs]e|copying|notice)([._-].*)?$", re.IGNORECASE)
LEGAL_MIN_DUP_PARAGRAPH = 80   # normalized chars; a repeated paragraph this long is kept once
LEGAL_MIN_UNIT_CHARS = 200


class SourceMissingError(RuntimeError):
    """A corpus source is not on this machine; the message says what to install or set."""


@dataclass(frozen=True)
class Unit:
    """One split unit: every document cut from one source (file, chapter, block of problems)."""

    source: str
    docs: tuple[str, ...]

    @property
    def chars(self) -> int:
        return sum(len(d) for d in self.docs)


# ----------------------------------------------------------------------------- helpers


def split_file(data_dir: str | Path, domain: str, split: str) -> Path:
    """``<data_dir>/<domain>/<split>.jsonl``, which ``make data`` writes.

    Raises:
        ValueError: if ``split`` is not one of :data:`SPLITS`.
        FileNotFoundError: if the file is missing (the message says to run ``make data``).
        ValueError: also if it is empty.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = Path(data_dir) / domain / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `make data` first (domain {domain!r})")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty: run `make data` again, or give the split some text")
    return path


def stable_key(*parts: object) -> int:
    """64-bit integer from sha256 of ``parts`` joined by ``:``; stable across runs and machines."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


_SENTENCE_END = re.compile(r"[.!?;:][\"')\]]*\s+")


def _split_long(line: str, limit: int) -> list[str]:
    """Cut one over-long line after sentence ends (else after spaces) into pieces of at most
    about ``limit`` characters; the pieces concatenate back to ``line``."""
    out = []
    while len(line) > limit:
        ends = [m.end() for m in _SENTENCE_END.finditer(line, 0, limit)] or \
               [m.end() for m in re.finditer(r"\s+", line[:limit])]
        cut = ends[-1] if ends and ends[-1] < len(line) else 0
        if cut <= 0:
            break
        out.append(line[:cut])
        line = line[cut:]
    return [*out, line]


def chunk_text(text: str, chunk_chars: int) -> list[str]:
    """Cut ``text`` at line boundaries into chunks of at most about ``chunk_chars`` characters.

    A chunk ends at the last blank line (paragraph / code block end) if that keeps it at least half
    full, else at the last line that fits. A line longer than ``chunk_chars`` (a long paragraph of
    prose) is first cut after a sentence end, or else after a space. Leading blank lines and
    trailing whitespace are dropped, so every chunk is a substring of ``text``; whitespace-only
    chunks are dropped.
    """
    if chunk_chars <= 0:
        raise ValueError(f"chunk_chars must be positive, got {chunk_chars}")
    pieces: list[str] = []
    cur: list[str] = []
    size = brk = brk_size = 0     # brk: index in cur just after the last blank line
    lines = [seg for ln in text.splitlines(keepends=True)
             for seg in (_split_long(ln, chunk_chars) if len(ln) > chunk_chars else (ln,))]
    for line in lines:
        if cur and size + len(line) > chunk_chars:
            cut, cut_size = (brk, brk_size) if brk and brk_size >= chunk_chars // 2 else (len(cur), size)
            pieces.append("".join(cur[:cut]))
            cur, size, brk, brk_size = cur[cut:], size - cut_size, 0, 0
        cur.append(line)
        size += len(line)
        if not line.strip():
            brk, brk_size = len(cur), size
    if cur:
        pieces.append("".join(cur))
    out = []
    for p in pieces:
        p = re.sub(r"\A(?:[ \t\f\r]*\n)+", "", p).rstrip()
        if p:
            out.append(p)
    return out


def _cfg_dict(cfg_data: Any) -> dict:
    if isinstance(cfg_data, DictConfig):
        return OmegaConf.to_container(cfg_data, resolve=True)  # type: ignore[return-value]
    return json.loads(json.dumps(dict(cfg_data)))  # deep copy of plain mappings/lists


def take_capped(candidates: Iterable[tuple[str, Callable[[], tuple[str, ...]]]], cap: int,
                *, seed: int, domain: str, chunk_chars: int) -> list[Unit]:
    """Whole units up to ``cap`` characters, drawn in salted-hash order, returned in input order.

    ``candidates`` are ``(source, load)`` pairs; ``load()`` returns the unit's documents (it is only
    called for units that are drawn, so a large corpus is not read in full). Units that would
    overflow the cap are skipped; the draw stops once less than ``chunk_chars`` of room is left.
    """
    cands = list(candidates)
    order = sorted(range(len(cands)), key=lambda i: (stable_key(seed, "select", domain, cands[i][0]), i))
    kept: dict[int, Unit] = {}
    total = 0
    for i in order:
        if cap - total < min(chunk_chars, cap):
            break
        source, load = cands[i]
        docs = load()
        chars = sum(len(d) for d in docs)
        if not docs or total + chars > cap:
            continue
        kept[i] = Unit(source, docs)
        total += chars
    return [kept[i] for i in sorted(kept)]


def split_units(units: list[Unit], *, seed: int, domain: str, val_fraction: float,
                test_fraction: float, min_docs: int = MIN_DOCS_PER_SPLIT,
                fixed: Mapping[str, str] | None = None) -> dict[str, list[Unit]]:
    """Assign units to train/val/test by rank of a salted sha256 of their source.

    Val takes units in rank order until it holds ``round(n * val_fraction)`` units (at least one)
    and at least ``min_docs`` documents; test then does the same; the rest is train. ``fixed``
    (source → split) places those units in their split; the others are split as above among
    themselves (``n`` their number; the documents of the fixed units count towards the floor). Each
    split keeps the units' input order. Raises ValueError if train is left with fewer than
    ``min_docs`` documents (too little data for this cap).
    """
    fixed = fixed or {}
    which: dict[int, str] = {i: fixed[u.source] for i, u in enumerate(units) if u.source in fixed}
    rank = sorted((i for i in range(len(units)) if i not in which),
                  key=lambda i: (stable_key(seed, "split", domain, units[i].source), i))
    pos = 0
    for split, fraction in (("val", val_fraction), ("test", test_fraction)):
        want, n_units = max(1, round(len(rank) * fraction)), 0
        n_docs = sum(len(units[i].docs) for i, s in which.items() if s == split)
        while pos < len(rank) and (n_units < want or n_docs < min_docs):
            which[rank[pos]] = split
            n_units, n_docs, pos = n_units + 1, n_docs + len(units[rank[pos]].docs), pos + 1
    out: dict[str, list[Unit]] = {s: [] for s in SPLITS}
    for i, u in enumerate(units):
        out[which.get(i, "train")].append(u)
    n_docs = {s: sum(len(u.docs) for u in out[s]) for s in SPLITS}
    if min(n_docs.values()) < min_docs:
        raise ValueError(f"{domain}: {len(units)} units / {sum(n_docs.values())} documents are too few for "
                         f"train/val/test with >= {min_docs} documents each ({n_docs}); "
                         f"raise data.max_chars.{domain}"
                         + {"math": " (or data.math_problems)", "chat": " (or data.chat_math_problems)"}.get(domain, ""))
    return out


# ----------------------------------------------------------------------------- coder


def stdlib_dir(path: str | None) -> Path:
    """The standard library to read: ``path`` if set, else this interpreter's ``stdlib``."""
    root = Path(path) if path else Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").is_file() and not any(root.glob("*.py")):
        raise SourceMissingError(f"Python standard library source not found at {root}: install the "
                                 "interpreter's library (e.g. Debian `libpython3-stdlib`), or set "
                                 "data.sources.python_stdlib=/path/to/lib/python3.X")
    return root


def stdlib_files(root: Path) -> list[Path]:
    """``.py`` files under ``root`` in sorted relative-path order, minus ``STDLIB_SKIP_DIRS``."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root).as_posix()
        keep = []
        for d in dirnames:
            sub = d if rel == "." else f"{rel}/{d}"
            if d in STDLIB_SKIP_DIRS or sub in STDLIB_SKIP_DIRS or os.path.islink(os.path.join(dirpath, d)):
                continue
            keep.append(d)
        dirnames[:] = keep
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def coder_units(cfg: dict) -> tuple[list[Unit], dict]:
    root = stdlib_dir(cfg["sources"].get("python_stdlib"))
    chunk = cfg["chunk_chars"]

    def loader(path: Path) -> Callable[[], tuple[str, ...]]:
        def load() -> tuple[str, ...]:
            try:
                text = path.read_bytes().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                return ()
            return tuple(chunk_text(text, chunk))
        return load

    cands = [(f"stdlib:{p.relative_to(root).as_posix()}", loader(p)) for p in stdlib_files(root)]
    units = take_capped(cands, cfg["max_chars"]["coder"], seed=cfg["seed"], domain="coder", chunk_chars=chunk)
    return units, {"path": str(root), "files_available": len(cands), "python": sys.version.split()[0]}


# ----------------------------------------------------------------------------- math

_NAMES = ("Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jon", "Kemi",
          "Luca", "Mei", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq")
_ITEMS = ("apples", "pencils", "notebooks", "tickets", "books", "mugs", "plants", "cards",
          "stamps", "marbles", "oranges", "candles")
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


def eval_exact(expr: str) -> Fraction:
    """Evaluate an integer arithmetic expression (``+ - * // %``, parentheses) exactly.

    Walks the ``ast`` with ``Fraction`` values, so it shares no code path with plain ``int``
    arithmetic. Raises ValueError on anything else (names, calls, floats, ``/``).
    """
    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression: {ast.dump(node)}")
    return ev(ast.parse(expr, mode="eval"))


def _num(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    d = rng.randint(lo_digits, hi_digits)
    return rng.randint(10 ** (d - 1), 10 ** d - 1)


def math_problem(rng: random.Random) -> tuple[str, int, str]:
    """One problem: ``(question, answer, check_expr)``.

    ``answer`` is computed with plain ints; ``check_expr`` restates it as an expression for
    ``eval_exact`` (the independent second route).
    """
    kind = rng.choices(("add", "sub", "mul", "chain", "quot", "rem", "word"),
                       weights=(14, 12, 14, 15, 8, 7, 30))[0]
    if kind in ("add", "sub", "mul"):
        a, b = (_num(rng, 2, 5), _num(rng, 2, 5)) if kind != "mul" else (_num(rng, 2, 4), _num(rng, 1, 3))
        sym = {"add": "+", "sub": "-", "mul": "*"}[kind]
        ans = {"add": a + b, "sub": a - b, "mul": a * b}[kind]
        return f"What is {a} {sym} {b}?", ans, f"{a} {sym} {b}"
    if kind == "chain":
        a, b, c = _num(rng, 1, 3), _num(rng, 1, 3), _num(rng, 1, 2)
        form = rng.randrange(4)
        expr, ans = [
            (f"{a} + {b} * {c}", a + b * c),
            (f"({a} - {b}) * {c}", (a - b) * c),
            (f"{a} * {b} - {c}", a * b - c),
            (f"({a} + {b}) * {c} - {b}", (a + b) * c - b),
        ][form]
        return f"What is {expr}?", ans, expr
    if kind in ("quot", "rem"):
        b = rng.randint(2, 99)
        a = rng.randint(b + 1, 99999)
        q, r = divmod(a, b)
        if kind == "quot":
            return f"What is the quotient when {a} is divided by {b}?", q, f"{a} // {b}"
        return f"What is the remainder when {a} is divided by {b}?", r, f"{a} % {b}"
    name = rng.choice(_NAMES)
    i1, i2 = rng.sample(_ITEMS, 2)
    form = rng.randrange(6)
    if form == 0:
        n1, p1, n2, p2 = rng.randint(2, 12), rng.randint(1, 40), rng.randint(2, 12), rng.randint(1, 40)
        return (f"{name} buys {n1} {i1} at {p1} dollars each and {n2} {i2} at {p2} dollars each. "
                f"How many dollars does {name} spend in total?",
                sum(n * p for n, p in ((n1, p1), (n2, p2))), f"{n1} * {p1} + {n2} * {p2}")
    if form == 1:
        n, p, extra = rng.randint(2, 15), rng.randint(1, 30), rng.randint(0, 200)
        m = n * p + extra
        return (f"{name} has {m} dollars and buys {n} {i1} at {p} dollars each. "
                f"How many dollars does {name} have left?", extra, f"{m} - {n} * {p}")
    if form in (2, 3):
        k = rng.randint(2, 12)
        t = rng.randint(k + 1, 500)
        q, r = divmod(t, k)
        if form == 2:
            return (f"{name} has {t} {i1} and shares them equally among {k} friends, giving each "
                    f"friend as many as possible. How many {i1} does each friend get?", q, f"{t} // {k}")
        return (f"{name} has {t} {i1} and shares them equally among {k} friends, giving each "
                f"friend as many as possible. How many {i1} are left over?", r, f"{t} % {k}")
    if form == 4:
        r1, d1, r2, d2 = rng.randint(5, 60), rng.randint(2, 14), rng.randint(5, 60), rng.randint(2, 14)
        return (f"{name} reads {r1} pages a day for {d1} days, then {r2} pages a day for {d2} days. "
                f"How many pages does {name} read in all?", r1 * d1 + r2 * d2, f"{r1} * {d1} + {r2} * {d2}")
    g, k = rng.randint(2, 20), rng.randint(2, 24)
    t = rng.randint(1, g * k)
    return (f"There are {g} boxes with {k} {i1} in each box. {name} takes away {t} {i1}. "
            f"How many {i1} remain?", g * k - t, f"{g} * {k} - {t}")


def format_problem(question: str, answer: int) -> str:
    """The one text format every math problem uses (exact-match evaluation parses ``Answer:``)."""
    return f"Question: {question}\nAnswer: {answer}"


def generate_math(n_problems: int, seed: int) -> tuple[list[str], int]:
    """``n_problems`` verified problems as text, each question once, and how many were rejected by the
    check. A question drawn again is skipped (not counted as rejected): the splits take blocks of
    problems, so a repeat could put the same problem in train and in test."""
    rng = random.Random(seed)
    out, rejected, seen = [], 0, set()
    while len(out) < n_problems:
        question, answer, check = math_problem(rng)
        if question in seen:
            continue
        exact = eval_exact(check)
        if exact.denominator != 1 or int(exact) != answer:
            rejected += 1
            continue
        seen.add(question)
        out.append(format_problem(question, answer))
    return out, rejected


def math_units(cfg: dict) -> tuple[list[Unit], dict]:
    problems, rejected = generate_math(cfg["math_problems"], cfg["seed"])
    cands = []
    for j in range(0, len(problems), PROBLEMS_PER_DOC):
        doc = "\n\n".join(problems[j:j + PROBLEMS_PER_DOC])
        cands.append((f"math:gen#{j // PROBLEMS_PER_DOC}", lambda doc=doc: (doc,)))
    units = take_capped(cands, cfg["max_chars"]["math"], seed=cfg["seed"], domain="math",
                        chunk_chars=cfg["chunk_chars"])
    return units, {"generator": "deltafleet.train.data.math_problem", "problems": len(problems), "rejected": rejected,
                   "problems_per_doc": PROBLEMS_PER_DOC}


# ----------------------------------------------------------------------------- writer

_AUSTEN_HELP = ("Jane Austen's novels (Debian package r-cran-janeaustenr) not found in {where}: "
                "run `make install` (an installed package without this checkout: `apt-get download "
                "r-cran-janeaustenr` and `dpkg -x` the .deb into a folder), or set "
                "data.sources.austen=/path/to/janeaustenr")


def find_austen(path: str | None, data_dir: Path) -> Path:
    """The janeaustenr ``data/`` folder (holding ``Rdata.rdx`` and ``Rdata.rdb``).

    Searches ``path`` alone if it is set (the package folder, its ``data/`` folder, or a ``dpkg -x``
    root), else ``/usr/lib/R/site-library/janeaustenr`` and
    ``<data_dir>/sources/janeaustenr/usr/lib/R/site-library/janeaustenr``.
    Raises SourceMissingError naming the package if none holds the files.
    """
    roots = [Path(path)] if path else [*AUSTEN_DEFAULT_DIRS, data_dir / AUSTEN_UNPACKED]
    for root in roots:
        for d in (root / "data", root, root / "usr/lib/R/site-library/janeaustenr/data"):
            if (d / "Rdata.rdx").is_file() and (d / "Rdata.rdb").is_file():
                return d
    raise SourceMissingError(_AUSTEN_HELP.format(where=[str(r) for r in roots]))


def _r_object(raw: bytes) -> Any:
    import rdata

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # "Unknown file type: assumed RDS": lazy-load blobs have no header
        return rdata.conversion.convert(rdata.parser.parse_data(raw))


def read_r_lazyload(data_dir: Path) -> dict[str, list[str]]:
    """Character vectors from an R lazy-load database (``Rdata.rdx`` index + ``Rdata.rdb`` blobs).

    The index is gzip-compressed R serialization of ``{"variables": {name: [offset, length]},
    "compressed": ...}``; each blob is a 4-byte big-endian uncompressed length followed by a zlib
    stream (R's ``compress=TRUE``; bzip2 / xz blobs carry a type byte after the length).
    Returns ``{name: lines}`` in sorted name order. Raises ValueError on a corrupt blob.
    """
    index = _r_object(gzip.decompress((data_dir / "Rdata.rdx").read_bytes()))
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    out = {}
    for name, (off, length) in sorted((str(k), v) for k, v in index["variables"].items()):
        blob = rdb[int(off):int(off) + int(length)]
        size = int.from_bytes(blob[:4], "big")
        kind, body = blob[4:5], blob[5:]
        if kind == b"Z":
            raw = lzma.decompress(body)
        elif kind == b"2":
            raw = bz2.decompress(body)
        elif kind == b"0":
            raw = body
        else:
            raw = zlib.decompress(blob[4:])
        if len(raw) != size:
            raise ValueError(f"{data_dir}/Rdata.rdb: object {name!r} is {len(raw)} bytes, index says {size}")
        out[name] = [str(x) for x in _r_object(raw)]
    return out


_HEADING = re.compile(r"(CHAPTER|Chapter|VOLUME|Volume)\s+([IVXLC]+|\d+)\.?")


def novel_chapters(lines: list[str]) -> list[list[str]]:
    """Paragraphs (wrapped lines joined by spaces) grouped by chapter.

    A ``CHAPTER``/``VOLUME`` heading starts a chapter; front matter joins the first chapter and
    a ``VOLUME`` heading joins the chapter it introduces.
    """
    paragraphs, cur = [], []
    for line in [*lines, ""]:
        if line.strip():
            cur.append(line.strip())
        elif cur:
            paragraphs.append(" ".join(cur))
            cur = []
    chapters: list[list[str]] = [[]]
    seen_heading = False
    for p in paragraphs:
        if _HEADING.fullmatch(p):
            if seen_heading and any(not _HEADING.fullmatch(q) for q in chapters[-1]):
                chapters.append([])
            seen_heading = True
        chapters[-1].append(p)
    return [c for c in chapters if c]


def writer_units(cfg: dict, data_dir: Path) -> tuple[list[Unit], dict]:
    where = find_austen(cfg["sources"].get("austen"), data_dir)
    novels = read_r_lazyload(where)
    chunk = cfg["chunk_chars"]
    cands = []
    for name, lines in novels.items():
        for i, chapter in enumerate(novel_chapters(lines), start=1):
            docs = tuple(chunk_text("\n\n".join(chapter), chunk))
            cands.append((f"austen:{name}#{i}", lambda docs=docs: docs))
    units = take_capped(cands, cfg["max_chars"]["writer"], seed=cfg["seed"], domain="writer",
                        chunk_chars=chunk)
    return units, {"path": str(where), "novels": sorted(novels), "chapters_available": len(cands)}


# ----------------------------------------------------------------------------- chat


def _conversation(user: str, assistant: str) -> str:
    """One conversation as the JSON document a chat unit holds."""
    return json.dumps([{"role": "user", "content": user}, {"role": "assistant", "content": assistant}],
                      ensure_ascii=False)


def function_conversations(text: str, key: tuple) -> list[str]:
    """Conversations about the documented top-level functions of one Python source ``text`` (at most
    :data:`CHAT_MAX_FUNCTION_LINES` lines each): write it from its signature and the first sentence of
    its docstring, or explain it with its docstring's first paragraph (which one: a salted hash of
    ``key`` and the name)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        src = ast.get_source_segment(text, node)
        if not doc or not src or src.count("\n") >= CHAT_MAX_FUNCTION_LINES:
            continue
        para = " ".join(doc.strip().split("\n\n")[0].split())
        sentence = para.split(". ")[0].rstrip(".")
        if len(sentence) < 20:
            continue
        signature = f"{node.name}({ast.unparse(node.args)})"
        if stable_key(*key, node.name) % 2:
            out.append(_conversation(f"Write a Python function `{signature}`: {sentence[0].lower()}{sentence[1:]}.",
                                     f"```python\n{src}\n```"))
        else:
            out.append(_conversation(f"What does this Python function do?\n\n```python\n{src}\n```", para))
    return out


def chat_units(cfg: dict, data_dir: Path) -> tuple[list[Unit], dict]:
    """Conversations from the standard library (one unit per file), the math generator (seeded apart
    from the math domain's; blocks of :data:`PROBLEMS_PER_DOC`) and Austen's chapters (each pair of
    neighbouring paragraphs of 200 to 1,500 characters, at most :data:`CHAT_PASSAGES_PER_CHAPTER`
    a chapter: continue the first), capped at ``max_chars.chat`` characters of JSON."""
    root = stdlib_dir(cfg["sources"].get("python_stdlib"))
    seed = cfg["seed"]
    cands: list[tuple[str, Callable[[], tuple[str, ...]]]] = []
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()

        def load(path=path, rel=rel) -> tuple[str, ...]:
            try:
                return tuple(function_conversations(path.read_bytes().decode("utf-8"), (seed, "chat", rel)))
            except (UnicodeDecodeError, OSError):
                return ()
        cands.append((f"chat:stdlib:{rel}", load))
    problems, _ = generate_math(cfg["chat_math_problems"], seed + 1)
    for j in range(0, len(problems), PROBLEMS_PER_DOC):
        docs = tuple(_conversation(q.removeprefix("Question: "), f"The answer is {a}.")
                     for q, a in (p.split("\nAnswer: ") for p in problems[j:j + PROBLEMS_PER_DOC]))
        cands.append((f"chat:math:gen#{j // PROBLEMS_PER_DOC}", lambda docs=docs: docs))
    where = find_austen(cfg["sources"].get("austen"), data_dir)
    for name, lines in read_r_lazyload(where).items():
        for i, chapter in enumerate(novel_chapters(lines), start=1):
            pairs = [(a, b) for a, b in zip(chapter, chapter[1:])
                     if 200 <= len(a) <= 1500 and 200 <= len(b) <= 1500]
            pairs = sorted(pairs, key=lambda ab: stable_key(seed, "chat", name, i, ab[0]))[:CHAT_PASSAGES_PER_CHAPTER]
            title = AUSTEN_TITLES.get(name, name)
            docs = tuple(_conversation(f"Continue this passage from Jane Austen's *{title}*:\n\n{a}", b)
                         for a, b in pairs)
            cands.append((f"chat:austen:{name}#{i}", lambda docs=docs: docs))
    units = take_capped(cands, cfg["max_chars"]["chat"], seed=seed, domain="chat", chunk_chars=cfg["chunk_chars"])
    kinds = {k: sum(len(u.docs) for u in units if u.source.startswith(f"chat:{k}:")) for k in ("stdlib", "math", "austen")}
    return units, {"conversations": kinds, "stdlib": str(root), "austen": str(where)}


# ----------------------------------------------------------------------------- legal


def licence_files(roots: Iterable[str]) -> list[Path]:
    """Licence files under ``roots``: every regular file directly in a root, plus files named
    copyright / LICENSE* / LICENCE* / COPYING* / NOTICE* one level down. Symlinks are skipped
    (their targets are in the tree); sorted by path."""
    found = set()
    for r in roots:
        root = Path(r)
        if not root.is_dir():
            continue
        for p in root.iterdir():
            if p.is_symlink():
                continue
            if p.is_file():
                found.add(p)
            elif p.is_dir():
                found.update(q for q in p.iterdir()
                             if not q.is_symlink() and q.is_file() and LICENSE_NAME.match(q.name))
    return sorted(found, key=lambda p: p.as_posix())


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def legal_units(cfg: dict) -> tuple[list[Unit], dict]:
    roots = list(cfg["sources"].get("licenses") or [])
    files = licence_files(roots)
    chunk = cfg["chunk_chars"]
    seen_files: set[str] = set()
    seen_paras: set[str] = set()
    cands = []
    dup_files = 0
    for path in files:
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if "\x00" in text:
            continue
        h = hashlib.sha256(_normalize(text).encode()).hexdigest()
        if h in seen_files:
            dup_files += 1
            continue
        seen_files.add(h)
        # Boilerplate (the GPL notice, "On Debian systems ...") recurs in hundreds of copyright
        # files; keep each long paragraph once, else it dominates the domain and leaks across splits.
        kept = []
        for para in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n")):
            norm = _normalize(para)
            if len(norm) >= LEGAL_MIN_DUP_PARAGRAPH:
                if norm in seen_paras:
                    continue
                seen_paras.add(norm)
            kept.append(para.rstrip())
        body = "\n\n".join(p for p in kept if p.strip())
        if len(body) >= LEGAL_MIN_UNIT_CHARS:
            docs = tuple(chunk_text(body, chunk))
            cands.append((f"license:{path.as_posix()}", lambda docs=docs: docs))
    if not cands:
        raise SourceMissingError(f"no licence texts found in {roots}: install Debian `base-files` "
                                 "(/usr/share/common-licenses), or set data.sources.licenses=[/path, ...]")
    units = take_capped(cands, cfg["max_chars"]["legal"], seed=cfg["seed"], domain="legal", chunk_chars=chunk)
    return units, {"roots": roots, "files_available": len(cands), "duplicate_files": dup_files}


# ----------------------------------------------------------------------------- general + driver


def general_mix(splits: Mapping[str, Mapping[str, list[Unit]]], fraction: float,
                seed: int) -> dict[str, list[dict]]:
    """``fraction`` of each domain's documents per split (lowest salted hashes, at least one),
    interleaved across domains in hash order. Records keep their original ``source``."""
    out: dict[str, list[dict]] = {}
    for split in SPLITS:
        picked = []
        for domain, by_split in splits.items():
            docs = [(stable_key(seed, "general", domain, u.source, j), d, u.source)
                    for u in by_split[split] for j, d in enumerate(u.docs)]
            docs.sort()
            picked += docs[:max(1, round(len(docs) * fraction))] if docs else []
        picked.sort()
        out[split] = [{"text": d, "source": s} for _, d, s in picked]
    return out


def record_chars(record: Mapping) -> int:
    """Characters of a record: its text, or its conversation as JSON (what ``max_chars`` counts)."""
    if "messages" in record:
        return len(json.dumps(record["messages"], ensure_ascii=False))
    return len(record["text"])


def _jsonl(records: Iterable[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def check_data_settings(cfg: Mapping) -> None:
    """Refuse, before any source is read, a ``data`` setting :func:`prepare` cannot use: ``domains`` a
    non-empty list of known domains, each once; ``seed`` an integer; ``val_fraction`` and
    ``test_fraction`` numbers in (0, 1) with a sum below 1; ``general_fraction`` a number in (0, 1];
    ``chunk_chars``, ``math_problems``, ``chat_math_problems`` and the ``max_chars`` of every domain
    built whole numbers ≥ 1.

    Raises:
        ValueError: naming the first bad setting as ``data.<key>`` and its value.
    """
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def real(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    domains = cfg.get("domains")
    if not isinstance(domains, list) or not domains or not all(isinstance(d, str) for d in domains):
        raise ValueError(f"data.domains must be a non-empty list of domains, e.g. data.domains=[general,coder]; "
                         f"got {domains!r}")
    unknown = sorted(set(domains) - set(DOMAINS))
    if unknown:
        raise ValueError(f"unknown data domains {unknown}; known: {list(DOMAINS)}")
    twice = next((d for d in domains if domains.count(d) > 1), None)
    if twice is not None:
        raise ValueError(f"data.domains lists {twice!r} twice")
    if not whole(cfg.get("seed")):
        raise ValueError(f"data.seed must be an integer, got {cfg.get('seed')!r}")
    for key in ("val_fraction", "test_fraction"):
        if not real(cfg.get(key)) or not 0 < cfg[key] < 1:
            raise ValueError(f"data.{key} must be a number between 0 and 1 (the share of a domain's "
                             f"documents), got {cfg.get(key)!r}")
    if cfg["val_fraction"] + cfg["test_fraction"] >= 1:
        raise ValueError(f"data.val_fraction + data.test_fraction must be below 1 (the rest is train), got "
                         f"{cfg['val_fraction']} + {cfg['test_fraction']}")
    if not real(cfg.get("general_fraction")) or not 0 < cfg["general_fraction"] <= 1:
        raise ValueError(f"data.general_fraction must be a number in (0, 1], got {cfg.get('general_fraction')!r}")
    built = [d for d in VARIANT_DOMAINS if d in domains or ("general" in domains and d in TEXT_DOMAINS)]
    max_chars = cfg.get("max_chars")
    counts = [("chunk_chars", cfg.get("chunk_chars")), ("math_problems", cfg.get("math_problems")),
              ("chat_math_problems", cfg.get("chat_math_problems")),
              *((f"max_chars.{d}", max_chars.get(d) if isinstance(max_chars, Mapping) else None) for d in built)]
    for key, value in counts:
        if not whole(value) or value < 1:
            raise ValueError(f"data.{key} must be a whole number ≥ 1, got {value!r}")


def prepare(cfg_data: Mapping | DictConfig, data_dir: Path) -> dict:
    """Build every domain in ``cfg_data.domains`` and write it under ``data_dir``.

    Args:
        cfg_data: the ``data`` config group (``conf/data/default.yaml``): domains, seed,
            val_fraction, test_fraction, chunk_chars, max_chars.<domain> (characters, before
            splitting), general_fraction, math_problems, sources.
        data_dir: output root; ``<data_dir>/<domain>/{train,val,test}.jsonl`` and
            ``<data_dir>/manifest.json`` are (over)written atomically.

    Returns:
        The manifest: ``{"domains": {domain: {split: {"docs", "units", "chars", "sha256"}}},
        "sources": {...}, "config": {...}, ...}`` (also written as ``manifest.json``).

    Raises:
        SourceMissingError: a source is not installed (the message says what to install).
        ValueError: a setting :func:`check_data_settings` refuses (before any source is read), or a
            split with fewer than ``MIN_DOCS_PER_SPLIT`` documents.
    """
    cfg = _cfg_dict(cfg_data)
    check_data_settings(cfg)
    data_dir = Path(data_dir)
    domains = list(cfg["domains"])
    build = tuple(d for d in VARIANT_DOMAINS if d in domains or ("general" in domains and d in TEXT_DOMAINS))
    builders = {"coder": coder_units, "math": math_units, "legal": legal_units,
                "writer": lambda c: writer_units(c, data_dir), "chat": lambda c: chat_units(c, data_dir)}
    splits: dict[str, dict[str, list[Unit]]] = {}
    sources: dict[str, dict] = {}

    def split(domain: str, units: list[Unit], fixed: Mapping[str, str] | None = None) -> dict[str, list[Unit]]:
        return split_units(units, seed=cfg["seed"], domain=domain, val_fraction=cfg["val_fraction"],
                           test_fraction=cfg["test_fraction"], fixed=fixed)

    for domain in build:
        t0 = time.perf_counter()
        units, sources[domain] = builders[domain](cfg)
        fixed = None
        if domain == "chat":  # a conversation made from a stdlib file or a chapter goes to that text's split
            fixed = {}
            for text_domain in CHAT_TEXT_SOURCES:
                by_split = splits.get(text_domain) or split(text_domain, builders[text_domain](cfg)[0])
                fixed.update({f"chat:{u.source}": s for s, us in by_split.items() for u in us})
        splits[domain] = split(domain, units, fixed)
        log.debug("%s: %d units in %.2f s", domain, len(units), time.perf_counter() - t0)

    records: dict[str, dict[str, list[dict]]] = {
        d: {s: [{"messages": json.loads(t), "source": u.source} if d in CHAT_DOMAINS else {"text": t, "source": u.source}
                for u in splits[d][s] for t in u.docs] for s in SPLITS}
        for d in build
    }
    if "general" in domains:
        records["general"] = general_mix({d: splits[d] for d in TEXT_DOMAINS}, cfg["general_fraction"], cfg["seed"])
    for domain in domains:
        for split in SPLITS:
            n = len(records[domain][split])
            if n < MIN_DOCS_PER_SPLIT:
                raise ValueError(f"{domain}/{split} has {n} documents (< {MIN_DOCS_PER_SPLIT}): raise "
                                 f"data.max_chars / data.math_problems or the split fractions")

    manifest: dict[str, Any] = {"format_version": MANIFEST_VERSION, "domains": {}, "sources": sources,
                                "config": cfg}
    for domain in domains:
        manifest["domains"][domain] = {}
        for split in SPLITS:
            recs = records[domain][split]
            blob = _jsonl(recs)
            write_bytes(data_dir / domain / f"{split}.jsonl", blob)
            manifest["domains"][domain][split] = {
                "docs": len(recs), "units": len({r["source"] for r in recs}),
                "chars": sum(record_chars(r) for r in recs), "sha256": hashlib.sha256(blob).hexdigest(),
            }
    text = json.dumps(manifest, indent=2, ensure_ascii=False) + "\n"
    write_bytes(data_dir / "manifest.json", text.encode("utf-8"))
    return manifest


def format_summary(manifest: Mapping) -> str:
    """A domain × split table of document and character counts."""
    rows = [f"{'domain':<8} " + " ".join(f"{s + ' docs':>11} {s + ' chars':>12}" for s in SPLITS)]
    for domain, by_split in manifest["domains"].items():
        rows.append(f"{domain:<8} " + " ".join(f"{by_split[s]['docs']:>11,} {by_split[s]['chars']:>12,}"
                                               for s in SPLITS))
    return "\n".join(rows)


@hydra.main(version_base="1.3", config_path="../conf", config_name="prepare")
def main(cfg: DictConfig) -> None:
    from deltafleet.cli import refuse_unknown_settings, user_errors
    from deltafleet.threads import set_threads

    refuse_unknown_settings(cfg, "prepare.yaml")  # a misspelt +key: `error: ...`, status 2, before any work
    with user_errors("data"):  # a bad threads setting: one line, not a traceback
        set_threads(cfg)
    t0 = time.perf_counter()
    data_dir = Path(cfg.paths.data_dir)
    try:
        with user_errors("data"):  # a bad data.* setting, too few documents: one line, not a traceback
            manifest = prepare(cfg.data, data_dir)
    except SourceMissingError as e:  # what the user must install: one line, not a traceback
        raise SystemExit(f"data: {e}") from None
    log.info("data written to %s in %.1f s\n%s", data_dir, time.perf_counter() - t0, format_summary(manifest))


if __name__ == "__main__":
    from deltafleet.cli import run_script

    run_script(main)
