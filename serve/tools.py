"""Tool calls in chat completions: OpenAI's ``tools`` / ``tool_choice`` in the Hermes format, which
the demo family's chat template (train/tokenizer.py) renders and vLLM's ``hermes`` parser reads.

The model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(several in a row for parallel calls). The server takes those blocks out of the text and answers them
as ``tool_calls`` with ``finish_reason: "tool_calls"``:

* a block is ``<tool_call>``, one JSON object (its end found by the JSON decoder, so a
  ``</tool_call>`` inside one of its strings does not end it), then ``</tool_call>``, whitespace
  allowed around the object; the object has a non-empty string ``name`` and an object
  ``arguments``, in strict JSON (``NaN``, ``Infinity`` and numbers past float range are not);
  ``arguments`` are sent on as JSON text (re-serialised: the separators ``", "`` and ``": "``);
* anything else that begins ``<tool_call>`` stays text, and so do blocks past ``max_calls``
  (``parallel_tool_calls: false``: one call);
* text that is only whitespace next to a call is dropped, other text is kept as it is;
* :func:`parse` does it for a whole text (non-streamed answers), :class:`ToolStream` piece by piece
  for a stream, with the same result: text goes out as soon as nothing after it can change it,
  a call once its closing tag has come;
* :func:`call_schema` is the JSON Schema of one call to one of the tools, from which
  serve/grammar.py builds the grammar that ``tool_choice: "required"`` or a named function holds
  the output to.

A leaf module.
"""
from __future__ import annotations

import json
import re
import uuid

START, END = "<tool_call>", "</tool_call>"
# where the JSON decoder fails on text cut short inside a literal, a number or a \u escape: what
# follows its error position then (more text can still make it JSON)
_PARTIAL = re.compile(r"t(?:ru?)?|f(?:a(?:ls?)?)?|n(?:ul?)?|-|\.|[eE][+-]?|u[0-9a-fA-F]{0,3}")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def call_id() -> str:
    """A new tool call's id (OpenAI's form)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(obj) -> dict | None:
    """``{"name", "arguments"}`` (arguments as JSON text) of a decoded block, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    try:
        text = json.dumps(args, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except ValueError:  # a number past float range (inf), or a lone surrogate escape: not UTF-8
        try:
            text = json.dumps(args, allow_nan=False)  # ASCII escapes: valid JSON whatever the code points
        except ValueError:
            return None
    return {"name": obj["name"], "arguments": text}


def as_tool_call(call: dict, index: int | None = None) -> dict:
    """OpenAI's ``tool_calls`` entry of a parsed call (``index`` for a stream's delta)."""
    out = {"id": call_id(), "type": "function", "function": dict(call)}
    return out if index is None else {"index": index, **out}


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":
        i += 1
    return i


def _block(text: str, i: int, final: bool) -> tuple[dict | None, int] | None:
    """The block whose ``<tool_call>`` ends at ``i``: ``(call or None if malformed, where it ends)``,
    or None when the text so far cannot tell yet (``final``: the text is whole, always tells)."""
    j = _skip_ws(text, i)
    try:
        obj, k = _DECODER.raw_decode(text, j)
    except ValueError as e:  # malformed JSON, NaN / Infinity, or (not final) JSON still coming
        incomplete = isinstance(e, json.JSONDecodeError) and (
            e.pos >= len(text) or e.msg.startswith("Unterminated string") or _PARTIAL.fullmatch(text, e.pos))
        return None if incomplete and not final else _malformed(text, i, final)
    k2 = _skip_ws(text, k)
    if text.startswith(END, k2):
        return _call(obj), k2 + len(END)
    if not final and END.startswith(text[k2:]):  # the closing tag is still coming
        return None
    return _malformed(text, k, final)


def _malformed(text: str, i: int, final: bool) -> tuple[None, int] | None:
    """A malformed block, as text up to the first closing tag from ``i`` (or, ``final``, to the end);
    None while that tag has not come."""
    end = text.find(END, i)
    if end < 0:
        return None if not final else (None, len(text))
    return None, end + len(END)


def _held(text: str) -> int:
    """How many characters at the end of ``text`` could begin :data:`START`."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


def _scan(text: str, pos: int, final: bool, calls_left: int) -> tuple[list[tuple[str, object]], int]:
    """The items of ``text[pos:]`` decided so far, ``("text", str)`` (text between blocks, possibly
    a piece of it), ``("block", str)`` (a block that stays text) or ``("call", dict)``, and where the
    undecided rest begins (``final``: nothing is left undecided)."""
    items: list[tuple[str, object]] = []
    while True:
        at = text.find(START, pos)
        if at < 0:
            stop = len(text) - (0 if final else _held(text[pos:]))
            if stop > pos:
                items.append(("text", text[pos:stop]))
            return items, stop
        if at > pos:
            items.append(("text", text[pos:at]))
        if calls_left <= 0:  # past max_calls: a block is text (up to the next block's start)
            items.append(("block", START))
            pos = at + len(START)
            continue
        got = _block(text, at + len(START), final)
        if got is None:
            return items, at
        call, end = got
        if call is None:
            items.append(("block", text[at:end]))
        else:
            items.append(("call", call))
            calls_left -= 1
        pos = end


def parse(text: str, max_calls: int | None = None) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a whole answer (module docstring): the text without its tool-call
    blocks (None if nothing is left) and each block's ``{"name", "arguments"}``, at most
    ``max_calls`` of them."""
    items, _ = _scan(text, 0, True, max_calls if max_calls is not None else len(text))
    calls = [v for k, v in items if k == "call"]
    if not calls:
        return text, []
    out = []
    for n, (kind, value) in enumerate(items):
        if kind != "call" and not (value.strip() == "" and (
                (n > 0 and items[n - 1][0] == "call") or (n + 1 < len(items) and items[n + 1][0] == "call"))):
            out.append(value)
    return "".join(out) or None, calls


class ToolStream:
    """One streamed choice's text, piece by piece, split into content and tool calls as :func:`parse`
    splits the whole. :meth:`feed` takes the next piece and :meth:`finish` the end; each returns
    ``(content, tool call deltas)``: the text to send now and OpenAI's ``delta.tool_calls`` entries."""

    def __init__(self, max_calls: int | None = None):
        self.text, self.pos = "", 0   # all text so far; where its undecided part begins
        self.calls = 0                # tool calls sent so far
        self.max_calls = max_calls
        self.ws = ""                  # the text between blocks so far, while it is all whitespace
        self.seg_text = False         # that text has more than whitespace: it is sent as it comes
        self.after_call = False       # that text follows a call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += text
        left = (self.max_calls if self.max_calls is not None else len(self.text) + 1) - self.calls
        items, self.pos = _scan(self.text, self.pos, final, left)
        out, deltas = [], []
        for kind, value in items:
            if kind == "text":
                if self.seg_text:
                    out.append(value)
                elif value.strip():
                    out.append(self.ws + value)
                    self.ws, self.seg_text = "", True
                else:
                    self.ws += value
                continue
            # a block ends the text before it: whitespace only, it is dropped beside a call
            if not self.seg_text and not (kind == "call" or self.after_call):
                out.append(self.ws)
            self.ws, self.seg_text = "", False
            if kind == "call":
                deltas.append(as_tool_call(value, self.calls))
                self.calls += 1
            else:
                out.append(value)
            self.after_call = kind == "call"
        if final:
            if not self.seg_text and not self.after_call:
                out.append(self.ws)
            self.ws = ""
        return "".join(out), deltas

    def finish(self) -> tuple[str, list[dict]]:
        """The rest at the end of the text: held text, and what can now be told."""
        return self.feed("", final=True)


def call_schema(tools: list[dict], name: str | None = None) -> dict:
    """The JSON Schema of one call ``{"name", "arguments"}`` to tool ``name`` (None: any of
    ``tools``), its arguments following the tool's ``parameters`` (none given: no arguments, ``{}``,
    as OpenAI reads a function without them). Each tool's schema sits under ``$defs`` as its own
    root, so that its references (``#``, ``#/$defs/...``, ``#/definitions/...``) resolve as they did."""
    options, defs = [], {}
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        params = f.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
        key = f"tool_{f['name']}"
        defs[key] = _rebase(params, f"#/$defs/{key}")
        options.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                                          "arguments": {"$ref": f"#/$defs/{key}"}},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs}


# a schema's keywords whose value is data (a ``$ref`` or a length limit in it is none), and those
# whose value maps names to schemas (a property named ``$ref`` is no keyword)
DATA = ("const", "enum", "default", "examples")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def map_schema(node: dict, fn) -> dict:
    """``node`` (a schema object) with ``fn`` applied to each keyword's value, but the values of
    :data:`DATA` keywords, left as they are, and the maps of :data:`SCHEMA_MAPS`, whose schemas
    ``fn`` takes one by one under their names."""
    out = {}
    for k, v in node.items():
        if k in DATA:
            out[k] = v
        elif k in SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {name: fn(s) for name, s in v.items()}
        else:
            out[k] = fn(v)
    return out


def _rebase(node, root: str):
    """``node`` (a schema) with every local ``$ref`` (``#…``) pointing under ``root`` instead of the
    document's root (:func:`map_schema`: none inside data)."""
    if isinstance(node, dict):
        out = map_schema(node, lambda v: _rebase(v, root))
        if isinstance(out.get("$ref"), str) and out["$ref"].startswith("#"):
            out["$ref"] = root + out["$ref"][1:]
        return out
    if isinstance(node, list):
        return [_rebase(v, root) for v in node]
    return node
