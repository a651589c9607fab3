"""Structured output: a request's output held to a grammar (JSON Schema, any JSON, a regular
expression, a choice of strings, an EBNF grammar) through xgrammar (Dong et al. 2024), as vLLM
does.

A request names its constraint as ``(kind, spec)`` (:data:`KINDS`; serve/protocol.py reads it from
``response_format`` and vLLM's ``guided_*`` / ``structured_outputs`` fields). :class:`Grammars`
compiles it once per distinct constraint against the served tokenizer (xgrammar keeps the compiled
grammars in its own cache), when the request is prepared, so a schema the library refuses is the
request's 400 and never reaches the model thread. The scheduler keeps one matcher per sequence:
before each step's sampling it writes every constrained row's allowed tokens into a bitmask (while
the GPU runs the step's forward), the sampler drops the others (serve/sampling.py,
``SamplingBatch.allowed``), and the sampled token advances the matcher. Unconstrained rows of the
same step are untouched, whatever their variant.

JSON is generated compact (no whitespace between tokens but the separators ``", "`` and ``": "``):
free whitespace lets a model emit it forever. ``strict`` JSON Schemas (OpenAI's ``strict: true``)
and plain ones are compiled the same, objects without properties beyond the schema's, as OpenAI's
strict mode has them.

A leaf module but for serve/request.py's errors (xgrammar is imported on first use).
"""
from __future__ import annotations

import json
import threading

import torch

from deltafleet.serve.request import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")  # json: spec a JSON Schema; json_object: none


class Grammars:
    """The grammars of the requests, compiled for ``tokenizer`` over a vocabulary of ``vocab_size``
    ids (the model's: ids past the tokenizer's are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler = None
        self._lock = threading.Lock()

    def compile(self, kind: str, spec: str | None, param: str = "response_format"):
        """The compiled grammar of the constraint ``(kind, spec)``: ``json`` (``spec`` a JSON Schema as
        JSON text), ``json_object`` (any JSON object; no spec), ``regex``, ``choice`` (a JSON list of
        strings) or ``grammar`` (EBNF, xgrammar's dialect of GBNF).

        Raises:
            InvalidRequestError: the library refuses it (``param`` names the request field).
        """
        compiler = self._get_compiler()
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "json_object":  # any object: not strict, or a schema without properties allows only {}
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "grammar":
                return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors derive from these
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"the {kind} constraint cannot be compiled: {first[:300]}", param,
                                      "invalid_constraint") from None
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    def matcher(self, compiled):
        """A fresh matcher of ``compiled`` (one per sequence: it follows that sequence's tokens)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

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
    """An EBNF grammar of exactly one of ``choices``: ``root ::= "a" | "b"``."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


