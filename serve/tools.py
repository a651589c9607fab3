"""Tool calls in chat completions: OpenAI's ``tools`` / ``tool_choice`` in the Hermes format, which
the demo family's chat template (train/tokenizer.py) renders and vLLM's ``hermes`` parser reads.

The model calls a tool by writing ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(several in a row for parallel calls). The server takes those blocks out of the text and answers them
as ``tool_calls`` with ``finish_reason: "tool_calls"``:

* :func:`parse` does it for a whole text (non-streamed answers);
* :class:`ToolStream` does it piece by piece for a stream: text outside the blocks goes out as
  ``content`` deltas at once, except a tail that could still begin ``<tool_call>``; a block goes out
  as one tool-call delta (id, name, arguments) once its closing tag has come;
* :func:`call_schema` is the JSON Schema of one call to one of the tools, from which
  serve/grammar.py builds the grammar that ``tool_choice: "required"`` or a named function holds
  the output to, so that the call always parses and its arguments follow the tool's schema.

A block whose content is not a JSON object with a string ``name`` and an object ``arguments`` is
left in the text, as vLLM does. A leaf module.
"""
from __future__ import annotations

import json
import re
import uuid

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


def call_id() -> str:
    """A new tool call's id (OpenAI's form)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(inner: str) -> dict | None:
    """``{"name", "arguments"}`` (arguments as JSON text) of a block's content, or None if it is not one."""
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def as_tool_call(call: dict, index: int | None = None) -> dict:
    """OpenAI's ``tool_calls`` entry of a parsed call (``index`` for a stream's delta)."""
    out = {"id": call_id(), "type": "function", "function": dict(call)}
    return out if index is None else {"index": index, **out}


def parse(text: str) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a whole answer: the text without its tool-call blocks (None if nothing
    but whitespace is left) and each block's ``{"name", "arguments"}``. With any block malformed, the
    text is returned whole and no call."""
    calls = []
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    rest = _BLOCK.sub("", text).strip()
    return rest or None, calls


def _held(text: str) -> int:
    """How many characters at the end of ``text`` could begin :data:`START`."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


class ToolStream:
    """One streamed choice's text, piece by piece, split into content and tool calls (module
    docstring). :meth:`feed` takes the next piece, :meth:`finish` the end; each returns ``(content,
    tool call deltas)``: the text to send now and OpenAI's ``delta.tool_calls`` entries."""

    def __init__(self):
        self.buf = ""
        self.in_call = False
        self.calls = 0  # tool calls sent so far

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        out, deltas = [], []
        while True:
            if not self.in_call:
                at = self.buf.find(START)
                if at < 0:
                    keep = _held(self.buf)
                    out.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                out.append(self.buf[:at])
                self.buf, self.in_call = self.buf[at + len(START):], True
            end = self.buf.find(END)
            if end < 0:
                break
            inner, self.buf, self.in_call = self.buf[:end], self.buf[end + len(END):], False
            call = _call(inner)
            if call is None:
                out.append(START + inner + END)
            else:
                deltas.append(as_tool_call(call, self.calls))
                self.calls += 1
        return "".join(out), deltas

    def finish(self) -> str:
        """The text still held at the end: an unfinished block as it was written, or a tail that
        began like one."""
        text = (START if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        return text


def call_schema(tools: list[dict], name: str | None = None) -> dict:
    """The JSON Schema of one call ``{"name", "arguments"}`` to tool ``name`` (None: any of
    ``tools``), its arguments following the tool's ``parameters`` (any object if it has none)."""
    options = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        params = f.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"anyOf": options}
