"""Token ids to text as they come, with stop strings (the scheduler's per-row detokenizer).

A leaf module.
"""
from __future__ import annotations

import codecs
import itertools
import json
import re
import threading
import weakref
from collections.abc import Sequence

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token
_SPACE = "\u2581"  # SentencePiece's word-boundary mark
CONTEXT_TOKENS = 6  # prompt tokens a completion's detokenizer starts from (vLLM: 5 before the last)
_kinds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer → (byte table or None, added ids)


def _kind(tokenizer) -> tuple[dict[str, int] | None, frozenset[int]]:
    """How ``tokenizer``'s tokens spell their bytes: the byte-level alphabet's inverse (GPT-2 style,
    ``ByteLevel`` decoder) or None (SentencePiece style: ``<0xNN>`` byte tokens, ``▁`` for spaces);
    and its added tokens' ids, whose text is their own."""
    if tokenizer not in _kinds:
        table = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
        stack = [decoder] if decoder else []
        while stack:
            d = stack.pop()
            if d.get("type") == "ByteLevel":
                from transformers.convert_slow_tokenizer import bytes_to_unicode

                table = {c: b for b, c in bytes_to_unicode().items()}
            stack += d.get("decoders") or []
        _kinds[tokenizer] = table, frozenset(tokenizer.get_added_vocab().values())
    return _kinds[tokenizer]


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """Each token's own bytes, which may be part of a UTF-8 character (OpenAI's logprobs ``bytes``,
    where the token decoded alone reads U+FFFD). Call under the tokenizer's lock."""
    table, added = _kind(tokenizer)
    out = []
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids)):
        byte = _BYTE_TOKEN.fullmatch(piece or "")
        if piece is None or i in added:
            out.append(tokenizer.decode([i]).encode())
        elif table is not None and all(c in table for c in piece):
            out.append(bytes(table[c] for c in piece))
        elif byte is not None:
            out.append(bytes([int(byte.group(1), 16)]))
        else:
            out.append(piece.replace(_SPACE, " ").encode())
    return out


def token_name(own: bytes) -> str:
    """How log-probabilities name a token of bytes ``own`` (:func:`token_bytes`), as OpenAI does: its
    text where they are whole UTF-8 (a SentencePiece token's leading space included), else
    ``bytes:\\xNN…`` (a piece of a character), so that two such pieces are two names."""
    try:
        return own.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in own)


def token_chars(name: str) -> int:
    """The characters a token named ``name`` (:func:`token_name`) counts for in ``text_offset``: its
    text's, and a piece of a character's as its bytes decode alone (U+FFFD for an unfinished character
    and for each byte that begins none)."""
    if name.startswith("bytes:\\x"):
        return len(bytes.fromhex(name[6:].replace("\\x", "")).decode("utf-8", "replace"))
    return len(name)


def _open_tail(tokenizer, ids: list[int], lock: threading.Lock) -> tuple[int, int]:
    """How many of the last tokens of ``ids`` hold the start of a UTF-8 character their bytes leave
    incomplete, and how many bytes of it they hold ((0, 0) when they end on a character's end, or in
    bytes that begin no character, such as F0 80): what a UTF-8 decoder holds back for more."""
    if not ids:
        return 0, 0
    with lock:
        pieces = token_bytes(tokenizer, ids)
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(b"".join(pieces[-4:])[-4:], final=False)  # a character is at most four bytes
    back = len(decoder.getstate()[0])
    n, count = 0, 0
    while n < back:  # the tokens that hold those bytes
        count += 1
        n += len(pieces[-count])
    return count, back


_specials: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer → its special tokens' ids


def _special_ids(tokenizer, lock: threading.Lock) -> frozenset[int]:
    """The ids of ``tokenizer``'s special tokens, which its decode leaves out with
    ``skip_special_tokens`` (none for a tokenizer that names none)."""
    if tokenizer not in _specials:
        with lock:
            added = getattr(tokenizer, "added_tokens_decoder", {})
            _specials[tokenizer] = frozenset(i for i, t in added.items() if getattr(t, "special", False))
    return _specials[tokenizer]


_runs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer → (byte token ids → byte, separator)


def _byte_runs(tokenizer) -> tuple[dict[int, int], int | None]:
    """A SentencePiece-style fast tokenizer's byte tokens (``<0xNN>``: id → byte; empty for byte-level
    BPE, whose every token is bytes, and for a tokenizer without a Rust backend) and a separator: a
    token that decodes to one plain character, alone and twice over, to decode text after a run of
    byte tokens with: the character's own token, else its byte token (a vocabulary need not hold a
    token of one letter; None where neither decodes so)."""
    if tokenizer not in _runs:
        ids: dict[int, int] = {}
        sep = None
        if getattr(tokenizer, "backend_tokenizer", None) is not None and _kind(tokenizer)[0] is None:
            ids = {i: int(m.group(1), 16) for t, i in tokenizer.get_vocab().items() if (m := _BYTE_TOKEN.fullmatch(t))}
        if ids:
            unk = getattr(tokenizer, "unk_token_id", None)
            for c, token in [(c, c) for c in "xaeo0"] + [(c, f"<0x{ord(c):02X}>") for c in "xaeo0"]:
                i = tokenizer.convert_tokens_to_ids(token)
                if i is not None and i != unk and tokenizer.decode([i]) == c and tokenizer.decode([i, i]) == c + c:
                    sep = i
                    break
        _runs[tokenizer] = ids, sep
    return _runs[tokenizer]


def _failure_table(stop: str) -> list[int]:
    """Knuth–Morris–Pratt: ``t[i]`` = the length of the longest proper prefix of ``stop[:i + 1]`` that
    is also its suffix."""
    t, k = [0] * len(stop), 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = t[k - 1]
        if stop[i] == stop[k]:
            k += 1
        t[i] = k
    return t


class TextStream:
    """Incremental detokenizer with stop strings, in time linear in the new text.

    Detokenizing, as vLLM and TGI do: each token decodes a short window of ids that starts at the
    previous step's new tokens (so a SentencePiece leading space comes out right) and releases what
    the window adds to their text; a window that ends in an incomplete UTF-8 sequence (U+FFFD) waits
    for the next token (with SentencePiece byte fallback, each run of byte tokens reads as a UTF-8
    decoder reads it: ``_decode_runs``). The first window starts at ``context``, the prompt's last
    :data:`CONTEXT_TOKENS` tokens: the first generated word keeps its leading space (a SentencePiece
    decoder strips the text's first one), and a character whose first bytes end the prompt and whose
    last ones the completion begins with is the completion's first character (vLLM drops it; the
    prompt's text ends with U+FFFD there). Stop strings: one Knuth–Morris–Pratt automaton per stop,
    fed each new character once; the automata's longest partial match is the text held back, since it may still
    begin a stop. The first stop completed ends the text just before it (of two completed by the
    same character, the longer), and :attr:`matched` names it (vLLM's ``stop_reason``); before
    ``min_tokens`` tokens none does, as in vLLM (a stop that begins before and is completed after counts).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], lock: threading.Lock, min_tokens: int = 0,
                 skip_special_tokens: bool = True, context: Sequence[int] = ()):
        self.tokenizer, self.lock = tokenizer, lock
        with lock:
            self._bytes, self._sep = _byte_runs(tokenizer)  # SentencePiece byte tokens: _decode_runs
        # A fast tokenizer's decode is its Rust backend's, then (with clean_up_tokenization_spaces)
        # a cleanup pass: without the cleanup, call the backend directly (a quarter of the time a token)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend if getattr(tokenizer, "clean_up_tokenization_spaces", True) is False else None
        self.min_tokens = min_tokens  # stop strings end nothing before this many tokens (vLLM's min_tokens)
        self.skip_special_tokens = skip_special_tokens  # vLLM's: false keeps e.g. a role token in the text
        self.stops = [s for s in stop if s]
        self.tables = [_failure_table(s) for s in self.stops]
        self.states = [0] * len(self.stops)  # characters of each stop matched by the text's end
        self.ids = list(context[-CONTEXT_TOKENS:])
        self.given = len(self.ids)  # ids[:given] are the prompt's, ids[given:] generated
        self.prefix = 0  # the window is ids[prefix:]; ids[prefix:read] are the previous step's
        self.read = self.given - _open_tail(tokenizer, self.ids, lock)[0]  # a character left open is the window's
        self.prefix_text = self._decode(self.ids) if self.ids else ""  # the window's text before its new tokens
        self.open = ""  # how the prompt's text ends in the open character (U+FFFD): the completion's if it ends it
        if self.read < self.given:  # the prompt's text before that character (its tokens may hold more: a space)
            closed = self.prefix_text.rstrip("\ufffd")
            self.prefix_text, self.open = closed, self.prefix_text[len(closed):]
        self.fed = 0  # characters the window adds that went through the automata already
        self.held = ""  # text checked but not released: it may begin a stop string
        self.matched: str | None = None  # the stop string that ended the text, once one did

    def _decode(self, ids: list[int]) -> str:
        with self.lock:
            if self._sep is not None and any(i in self._bytes for i in ids):
                return self._decode_runs(ids)
            return self._decode_plain(ids)

    def _decode_plain(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_runs(self, ids: list[int]) -> str:
        """SentencePiece byte fallback, with each run of byte tokens decoded as UTF-8 decodes it. The
        tokenizer reads a run that is not whole UTF-8 as one U+FFFD a byte, whole characters included,
        so a character released once would read U+FFFD when a stray byte follows it (text taken back).
        The text between runs is the tokenizer's, after the separator (its leading space kept); a
        character the last run leaves open reads one U+FFFD, as a byte-level decoder's does."""
        out: list[str] = []
        groups = [(is_bytes, list(group)) for is_bytes, group in itertools.groupby(ids, key=self._bytes.__contains__)]
        for n, (is_bytes, group) in enumerate(groups):
            if is_bytes:
                data = bytes(self._bytes[i] for i in group)
                if n + 1 < len(groups):
                    out.append(data.decode("utf-8", "replace"))
                else:  # the window's end: an open character waits (one U+FFFD)
                    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
                    out.append(utf8.decode(data, final=False) + ("\ufffd" if utf8.getstate()[0] else ""))
            else:
                # (the separator decodes to one character: _byte_runs)
                out.append(self._decode_plain(group) if not out else self._decode_plain([self._sep, *group])[1:])
        return "".join(out)

    def _close(self, new: str) -> str:
        """The window's new text once something follows the prompt's open character: without that
        character's U+FFFD if the completion did not finish it (it is the prompt's)."""
        if new.startswith(self.open):
            self.prefix_text += self.open
            new = new[len(self.open):]
        self.open = ""
        return new

    def push(self, token: int) -> tuple[str, bool]:
        """Add a token; return (newly released text, whether a stop string was reached)."""
        self.ids.append(token)
        new = self._decode(self.ids[self.prefix:])[len(self.prefix_text):]
        stable = len(new.rstrip("\ufffd"))
        if self.open and stable:
            closed = self._close(new)
            new, stable = closed, stable - (len(new) - len(closed))
        chars, self.fed = new[self.fed:stable], max(self.fed, stable)
        if stable == len(new):  # complete: the next window starts at this step's tokens
            self.prefix, self.read = self.read, len(self.ids)
            self.prefix_text = self._decode(self.ids[self.prefix:self.read])
            self.fed = 0
        return self._check(chars)

    def _check(self, chars: str) -> tuple[str, bool]:
        if not self.stops:
            return chars, False
        for i, c in enumerate(chars):
            hit = ""
            for k, (stop, table) in enumerate(zip(self.stops, self.tables)):
                n = self.states[k]
                while n and stop[n] != c:
                    n = table[n - 1]
                if stop[n] == c:
                    n += 1
                    if n == len(stop):
                        hit, n = max(hit, stop, key=len), table[n - 1]
                self.states[k] = n
            if hit and len(self.ids) - self.given >= self.min_tokens:  # (one completed earlier ends nothing)
                text = self.held + chars[:i + 1]
                self.held, self.matched = "", hit
                return text[:len(text) - len(hit)], True
        text = self.held + chars
        cut = len(text) - max(self.states)
        out, self.held = text[:cut], text[cut:]
        return out, False

    def _open_tokens(self) -> int:
        """How many of the last generated tokens hold a character they begin and leave unfinished,
        from the token of its first byte on (0: none). The special tokens the text leaves out
        (``skip_special_tokens``) are no bytes of it: one after the character does not finish it."""
        skipped = _special_ids(self.tokenizer, self.lock) if self.skip_special_tokens else frozenset()
        at = [i for i in range(self.given, len(self.ids)) if self.ids[i] not in skipped][-4:]  # ≤ 4 bytes a character
        n = _open_tail(self.tokenizer, [self.ids[i] for i in at], self.lock)[0] if at else 0
        return len(self.ids) - at[-n] if n else 0

    def flush(self) -> tuple[str, bool]:
        """The generation ended: the rest of the text (what was held back), cut before a stop string it
        completes; and whether it did. A character the generated tokens begin and never finish is
        dropped, as vLLM drops it (its U+FFFD would end the text); bytes that are no UTF-8 at all
        stay U+FFFD."""
        new = self._decode(self.ids[self.prefix:])[len(self.prefix_text):]
        tokens = self._open_tokens() if new.endswith("\ufffd") else 0
        if tokens and _kind(self.tokenizer)[0] is None:
            # byte tokens (SentencePiece's byte fallback): a run of them that does not decode whole reads
            # U+FFFD a byte, the whole characters before the open one too, so decode without its tokens
            new = self._decode(self.ids[self.prefix:max(self.prefix, len(self.ids) - tokens)])[len(self.prefix_text):]
        elif tokens:  # byte-level BPE: one U+FFFD for the open character, the text before it as it was
            new = new[:-1]
        if self.open:
            new = self._close(new)
        rest, self.fed = new[self.fed:], len(new)
        out, stopped = self._check(rest)
        out, self.held = out + self.held, ""
        return out, stopped
