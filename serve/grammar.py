"""Structured output: a request's output held to a grammar (JSON Schema, any JSON, a regular
expression, a choice of strings, an EBNF grammar) through xgrammar (Dong et al. 2024), as vLLM
does.

A request names its constraint as ``(kind, spec)`` (:data:`KINDS`; serve/protocol.py reads it from
``response_format`` and vLLM's ``guided_*`` / ``structured_outputs`` fields). :class:`Grammars`
compiles it once per distinct constraint against the served tokenizer (xgrammar keeps the compiled
grammars in its own cache), when the request is prepared, so a schema the library refuses is the
request's 400 and never reaches the model thread. The scheduler keeps one matcher per sequence:
before each step's sampling it writes every constrained row's allowed tokens into a bitmask in one
call (xgrammar's batch matcher, on its own threads, while the GPU runs the step's forward), the
sampler drops the others (serve/sampling.py,
``SamplingBatch.allowed``), and the sampled token advances the matcher. Unconstrained rows of the
same step are untouched, whatever their variant.

JSON is generated compact (no whitespace between tokens but the separators ``", "`` and ``": "``):
free whitespace lets a model emit it forever. A string with ``minLength``/``maxLength`` holds no
escapes (:func:`string_lengths`). ``strict`` JSON Schemas (OpenAI's ``strict: true``)
and plain ones are compiled the same, objects without properties beyond the schema's, as OpenAI's
strict mode has them.

A leaf module but for serve/request.py's errors and serve/tools.py's call format (xgrammar is
imported on first use).
"""
from __future__ import annotations

import json
import os
import threading

import torch

from deltafleet.serve import tools
from deltafleet.serve.request import InvalidRequestError

# json: spec a JSON Schema; json_object: none; tool_call: {"tools": [...], "name": one of them or null} as JSON
KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_call")
FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))  # threads filling a step's bitmask rows


class Grammars:
    """The grammars of the requests, compiled for ``tokenizer`` over a vocabulary of ``vocab_size``
    ids (the model's: ids past the tokenizer's are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler = None
        self._batch = None  # the scheduler thread's xgrammar BatchGrammarMatcher (made on first use)
        self._lock = threading.Lock()

    def compile(self, kind: str, spec: str | None, param: str = "response_format"):
        """The compiled grammar of the constraint ``(kind, spec)``: ``json`` (``spec`` a JSON Schema as
        JSON text), ``json_object`` (any JSON object; no spec), ``regex``, ``choice`` (a JSON list of
        strings), ``grammar`` (EBNF, xgrammar's dialect of GBNF) or ``tool_call`` (one call to one of
        the tools, or to the one named, in serve/tools.py's format).

        Raises:
            InvalidRequestError: the library refuses it (``param`` names the request field).
        """
        compiler = self._get_compiler()
        try:
            if kind == "json":
                return compiler.compile_json_schema(json.dumps(string_lengths(json.loads(spec), param)),
                                                    any_whitespace=False)
            if kind == "json_object":  # any object: not strict, or a schema without properties allows only {}
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "grammar":
                return compiler.compile_grammar(spec)
            if kind == "tool_call":  # <tool_call>{"name": ..., "arguments": ...}</tool_call> (serve/tools.py)
                import xgrammar as xgr

                asked = json.loads(spec)
                schema = string_lengths(tools.call_schema(asked["tools"], asked["name"]), param)
                return compiler.compile_grammar(xgr.Grammar.concat(
                    xgr.Grammar.from_ebnf(f'root ::= "{tools.START}"'),
                    xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                    xgr.Grammar.from_ebnf(f'root ::= "{tools.END}"')))
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors derive from these
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"the {kind} constraint cannot be compiled: {first[:300]}", param,
                                      "invalid_constraint") from None
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    def matcher(self, compiled):
        """A fresh matcher of ``compiled`` (one per sequence: it follows that sequence's tokens)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        """Write each matcher's allowed next tokens into its row of ``bitmask`` (row i: ``matchers[i]``),
        all in one call: xgrammar's batch matcher fills the rows on its own threads, outside the
        interpreter, where one call per row would take the interpreter back 64 times a step from the
        HTTP threads. Called by the scheduler thread only."""
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def bitmask(self, rows: int) -> torch.Tensor:
        """A host bitmask for ``rows`` rows (int32 ``[rows, ceil(vocab / 32)]``, all tokens allowed)."""
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar of exactly one of ``choices``: ``root ::= "a" | "b"`` (characters past U+FFFF
    as they are: the grammar reads a JSON escape's surrogate pair as two characters)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# What a string of a JSON Schema with minLength/maxLength may hold (xgrammar 0.2.9 lets control
# characters into such strings, which no JSON parser takes): no quote, backslash or control character.
_PLAIN = r'[^"\\\x00-\x1f]'


def string_lengths(schema, param: str = "response_format"):
    """``schema`` with every string's ``minLength``/``maxLength`` written as a ``pattern`` of
    :data:`_PLAIN` characters (a string with a length limit holds no escapes). xgrammar's own length
    limit lets control characters in, and it ignores the limit beside a ``pattern``.

    Raises:
        InvalidRequestError: a string has both a pattern and a length limit (not supported).
    """
    if isinstance(schema, list):
        return [string_lengths(s, param) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: string_lengths(v, param) for k, v in schema.items()}
    if out.get("type") == "string" and ("minLength" in out or "maxLength" in out):
        if "pattern" in out:
            raise InvalidRequestError("a string with both `pattern` and `minLength`/`maxLength` is not supported "
                                      "in structured output", param, "invalid_constraint")
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_PLAIN}{{{lo},{hi}}}$"
    return out


