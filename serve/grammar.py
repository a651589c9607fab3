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

Every JSON number the grammar writes is bounded in length (:func:`bounded_numbers`): at most
:data:`INTEGER_DIGITS` digits before the point, :data:`FRACTION_DIGITS` after it and
:data:`EXPONENT_DIGITS` in the exponent. xgrammar's digit runs are unbounded, and a small model
decoding greedily can repeat a digit until ``max_tokens`` (``1.25000000000000012500…``), leaving
JSON that never parses. A JSON Schema is turned into xgrammar's EBNF, bounded, and compiled as
text: xgrammar caches the compiled grammar by that text, and :func:`json_grammar` keeps the text.

A leaf module but for serve/request.py's errors and serve/tools.py's call format (xgrammar is
imported on first use).
"""
from __future__ import annotations

import functools
import json
import os
import re
import threading

import torch

from deltafleet.serve import tools
from deltafleet.serve.request import InvalidRequestError
from deltafleet.values import real

# json: spec a JSON Schema; json_object: none; tool_call: {"tools": [...], "name": one of them or null} as JSON
KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_call")
FILL_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))  # threads filling a step's bitmask rows
# Digits a JSON number may have (bounded_numbers): integers up to 15 digits are exact in float64 (below
# 2**53, JavaScript's safe integers); 17 significant digits round-trip any float64, so any double of
# magnitude 0.1 or more can be written without an exponent; float64 exponents run from -324 to 308.
INTEGER_DIGITS, FRACTION_DIGITS, EXPONENT_DIGITS = 15, 17, 3
# An integer's multipleOf automaton of more states than this is left unbounded: unrolled, it takes
# states × INTEGER_DIGITS rules (for 1,000 some 15,000 rules, 5 MB of grammar and seconds of
# compiling per field: a request could tie up the server with a few).
UNROLL_STATES = 128


class Grammars:
    """The grammars of the requests, compiled for ``tokenizer`` over a vocabulary of ``vocab_size``
    ids (the model's: ids past the tokenizer's are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler = None
        self._batch = None  # the scheduler thread's xgrammar BatchGrammarMatcher (made on first use)
        self._pinned = None  # the scheduler thread's page-locked bitmask (bitmask(pinned=True))
        self._lock = threading.Lock()

    def compile(self, kind: str, spec: str | None, param: str = "response_format"):
        """The compiled grammar of the constraint ``(kind, spec)``: ``json`` (``spec`` a JSON Schema as
        JSON text), ``json_object`` (any JSON object; no spec), ``regex``, ``choice`` (a JSON list of
        strings), ``grammar`` (EBNF, xgrammar's dialect of GBNF) or ``tool_call`` (one call to one of
        the tools, or to the one named, in serve/tools.py's format).

        Raises:
            InvalidRequestError: the library refuses it, or no text satisfies it (no token may start
                it, as in ``root ::= root``); ``param`` names the request field.
        """
        compiled = self._compile(kind, spec, param)
        if not self._can_start(compiled):
            raise InvalidRequestError(f"the {kind} constraint accepts no text: no token can begin it", param,
                                      "invalid_constraint")
        return compiled

    def _can_start(self, compiled) -> bool:
        """Whether some token (or the end, where the empty text is accepted) may come first. A bitmask
        of its own, not :meth:`bitmask`'s: that one is the scheduler thread's, this runs in a request's."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())

    def _compile(self, kind: str, spec: str | None, param: str):
        compiler = self._get_compiler()
        try:
            if kind == "json":
                schema = json.loads(spec)
                enforceable(schema, param)
                return compiler.compile_grammar(json_grammar(json.dumps(string_lengths(schema, param))))
            if kind == "json_object":  # any object: not strict, or a schema without properties allows only {}
                return compiler.compile_grammar(json_grammar('{"type": "object"}', strict=False))
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(spec)))
            if kind == "grammar":
                return compiler.compile_grammar(spec)
            if kind == "tool_call":  # <tool_call>{"name": ..., "arguments": ...}</tool_call> (serve/tools.py)
                import xgrammar as xgr

                asked = json.loads(spec)
                for i, t in enumerate(asked["tools"]):  # each where the request has it, before the wrapper
                    if asked["name"] in (None, t["function"]["name"]) and t["function"].get("parameters"):
                        params = t["function"]["parameters"]
                        at = f"tools.{i}.function.parameters"
                        enforceable(params, at, at, params)
                schema = tools.call_schema(asked["tools"], asked["name"])
                schema = string_lengths(schema, param)
                return compiler.compile_grammar(str(xgr.Grammar.concat(
                    xgr.Grammar.from_ebnf(f'root ::= "{tools.START}"'),
                    xgr.Grammar.from_ebnf(json_grammar(json.dumps(schema))),
                    xgr.Grammar.from_ebnf(f'root ::= "{tools.END}"'))))
        except InvalidRequestError:
            raise
        except RecursionError:
            raise InvalidRequestError(f"the {kind} constraint nests too deeply to be compiled", param,
                                      "invalid_constraint") from None
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors derive from these
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = _LIBRARY_PREFIX.sub("", first)  # xgrammar's "[12:15:19] /project/cpp/x.cc:5082: "
            raise InvalidRequestError(f"the {kind} constraint cannot be compiled: {first[:300]}", param,
                                      "invalid_constraint") from None
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")

    def matcher(self, compiled):
        """A fresh matcher of ``compiled`` (one per sequence: it follows that sequence's tokens)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
        """Write each matcher's allowed next tokens into its row of ``bitmask`` (``matchers[i]`` into row
        ``rows[i]``, or row i), all in one call: xgrammar's batch matcher fills the rows on its own
        threads, outside the interpreter, where one call per row would take the interpreter back 64
        times a step from the HTTP threads. Other rows are left as they are. Called by the scheduler
        thread only."""
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)

    def bitmask(self, rows: int, pinned: bool = False) -> torch.Tensor:
        """A host bitmask for ``rows`` rows (int32 ``[rows, ceil(vocab / 32)]``), all tokens allowed.
        ``pinned``: a view of one page-locked buffer instead, kept and reused (grown as needed) so a
        step's copy to the GPU does not wait for the host; valid until the next call. Called by the
        scheduler thread only."""
        import xgrammar as xgr

        if not pinned:
            return xgr.allocate_token_bitmask(rows, self.vocab_size)
        if self._pinned is None or self._pinned.shape[0] < rows:
            shape = xgr.get_bitmask_shape(max(rows, 64), self.vocab_size)
            self._pinned = torch.empty(shape, dtype=torch.int32, pin_memory=True)
        return self._pinned[:rows].fill_(-1)

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


_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# keywords xgrammar (0.2.9) accepts but does not hold the output to: refused rather than ignored
_UNENFORCED = ("not", "if", "then", "else", "contains", "minContains", "maxContains", "dependentRequired",
               "dependentSchemas", "dependencies")
# what may sit beside a lone ``allOf`` (xgrammar holds one subschema, but not siblings or a second one)
_BESIDE_ALLOF = {"allOf", "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                 "writeOnly", "$defs", "definitions", "$schema", "$id"}
# JSON Schema's assertions and applicators that xgrammar ignores beside ``anyOf``/``oneOf``: it writes the
# branches alone (a ``oneOf`` beside ``anyOf`` is dropped too, and a ``$ref`` beside either is followed
# alone, the branches dropped: both refused by enforceable). An enum or const beside them is written
# instead of them: it holds, the branches do not. Annotations and keywords that are no part of JSON
# Schema (OpenAPI's discriminator, x-...) constrain nothing there anyway.
_BESIDE_UNION_IGNORED = ("type", "properties", "required", "additionalProperties", "propertyNames", "minProperties",
                         "maxProperties", "items", "prefixItems", "additionalItems", "minItems", "maxItems",
                         "unevaluatedItems", "unevaluatedProperties", "minimum", "maximum", "exclusiveMinimum",
                         "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "format", "allOf")
# an integer's multipleOf xgrammar (0.2.9) holds: a whole number up to MULTIPLE_OF_MAX, alone or beside a
# range closed on both sides of at most MULTIPLE_OF_RANGE integers (it drops any other, with a warning)
MULTIPLE_OF_MAX, MULTIPLE_OF_RANGE = 1024, 10_000
# string formats xgrammar (0.2.9) writes a grammar of: it then ignores a pattern or length limit beside one
_FORMATS = ("email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
            "uri-reference", "uri-template", "json-pointer", "relative-json-pointer")
# keywords whose value is a map of names to schemas, and those whose value is a schema or a list of them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "propertyNames",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")


def enforceable(schema, param: str = "response_format", where: str = "schema", root=None) -> None:
    """Refuse a JSON Schema the grammar would not hold the output to: any of :data:`_UNENFORCED`,
    ``uniqueItems: true``, ``multipleOf`` but an integer's (and an integer's that xgrammar drops,
    :func:`_dropped_multiple`), ``patternProperties`` (its objects may
    repeat a key), a ``$ref`` outside the schema, ``allOf`` with more than one subschema or with
    constraints beside it, a ``pattern``, ``minLength`` or ``maxLength`` beside a ``format`` of
    :data:`_FORMATS`, an assertion or applicator beside ``anyOf``/``oneOf``
    (:data:`_BESIDE_UNION_IGNORED`: ``type``, ``properties``, ``items``, ...; a ``type`` that every
    value xgrammar writes for the union has anyway, :func:`_written_types`, is taken), a ``oneOf`` beside
    ``anyOf``, and ``anyOf``/``oneOf``, an ``enum``, a ``const`` or an assertion beside a ``$ref``
    (which xgrammar follows alone; a ``type`` its schema has anyway is taken) (xgrammar
    accepts them and ignores them, so the output could break the schema). An ``enum`` or ``const``
    beside ``anyOf``/``oneOf`` is taken: xgrammar holds the output to it, not to the branches.

    ``root``: the schema ``schema`` is part of (None: ``schema`` itself), which its ``$ref`` name.

    Raises:
        InvalidRequestError: naming the keyword and where it is (``schema.properties.a.not``).
    """
    root = schema if root is None else root
    if isinstance(schema, list):
        for i, s in enumerate(schema):
            enforceable(s, param, f"{where}.{i}", root)
        return
    if not isinstance(schema, dict):
        return

    def refuse(key: str, why: str = ""):
        raise InvalidRequestError(f"`{key}` (at {where}.{key}) is not supported in structured output: the grammar "
                                  f"would not enforce it{why}", param, "invalid_constraint")

    def refuse_beside(keys, why: str):  # a type every value written has anyway is no loss
        for key in keys:
            if key in schema and not (key == "type" and _within(_written_types(schema, root), schema["type"])):
                refuse(key, why)

    for key in _UNENFORCED:
        if key in schema:
            refuse(key)
    if schema.get("uniqueItems") is True:
        refuse("uniqueItems")
    if "multipleOf" in schema and schema.get("type") != "integer":
        refuse("multipleOf", " on a number (an integer's is)")
    if "multipleOf" in schema and (why := _dropped_multiple(schema)):
        refuse("multipleOf", why)
    if "patternProperties" in schema:
        refuse("patternProperties", " (it lets an object repeat a key)")
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        refuse("$ref", " (only a reference within the schema, #/..., is followed)")
    if isinstance(ref, str) and _resolve(root, ref) is None:
        refuse("$ref", f" ({ref!r} names nothing in the schema: a reference is # or #/a/b)")
    if schema.get("format") in _FORMATS:
        for key in ("pattern", "minLength", "maxLength"):
            if key in schema:
                refuse(key, f" beside `format: {schema['format']}`")
    if "$ref" in schema:  # followed alone: an assertion beside it goes unheld ({"$ref": int, "minimum": 5}: 1)
        refuse_beside((*_BESIDE_UNION_IGNORED, "enum", "const"),
                      " beside `$ref` (the reference alone is followed: write it in the schema it names)")
    if "anyOf" in schema and "oneOf" in schema:  # xgrammar writes the anyOf alone
        refuse("oneOf", " beside `anyOf` (only the anyOf is written)")
    for union in ("anyOf", "oneOf"):  # xgrammar writes the branches alone, a nullable string's limit unheld
        if union in schema:
            if "$ref" in schema:  # followed alone: the branches are what goes unheld
                refuse(union, " beside `$ref` (the reference alone is followed)")
            refuse_beside(_BESIDE_UNION_IGNORED, f" beside `{union}` (write it in each of its subschemas)")
    if "allOf" in schema:
        sub = schema["allOf"]
        if not isinstance(sub, list) or len(sub) != 1 or set(schema) - _BESIDE_ALLOF:
            refuse("allOf", " (only one subschema, with nothing but annotations beside it, is)")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, s in schema[key].items():
                enforceable(s, param, f"{where}.{key}.{name}", root)
    for key in _SUBSCHEMAS:
        if key in schema:
            enforceable(schema[key], param, f"{where}.{key}", root)


def _written_types(schema, root, depth: int = 0, refs: dict | None = None) -> set[str] | None:
    """The JSON types of the values xgrammar (0.2.9) writes for ``schema``, read in its order: a
    ``$ref`` (within ``root``), else a ``const``, an ``enum``, ``anyOf``/``oneOf`` (every branch's),
    one ``allOf`` subschema, a ``type``. None where it could write any value or where that is not
    known (a reference it cannot follow here, a schema without any of these, a cycle).

    ``refs``: each reference's types once read (None while it is being read: a cycle), so that
    branches naming one reference read it once (``{"anyOf": [{"$ref": "#"}, {"$ref": "#"}]}`` took
    2⁶⁴ calls)."""
    if not isinstance(schema, dict) or depth > 64:
        return None
    refs = {} if refs is None else refs
    if "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str):
            return None
        if ref not in refs:
            refs[ref] = None  # being read: a reference met again on the way is a cycle
            target = _resolve(root, ref)
            refs[ref] = None if target is None else _written_types(target, root, depth + 1, refs)
        return refs[ref]
    if "const" in schema:
        return {_json_type(schema["const"])}
    if isinstance(schema.get("enum"), list):
        return {_json_type(v) for v in schema["enum"]}
    for union in ("anyOf", "oneOf"):
        if isinstance(schema.get(union), list):
            parts = [_written_types(s, root, depth + 1, refs) for s in schema[union]]
            return None if not parts or None in parts else set().union(*parts)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
        return _written_types(schema["allOf"][0], root, depth + 1, refs)
    kind = schema.get("type")
    if isinstance(kind, str) or (isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind)):
        return {kind} if isinstance(kind, str) else set(kind)
    return None


def _within(types: set[str] | None, kind) -> bool:
    """Whether every one of ``types`` (:func:`_written_types`) is a ``kind`` (a ``type`` keyword's
    value: a name or a list of them; an integer is a number)."""
    kinds = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    return types is not None and all(t in kinds or (t == "integer" and "number" in kinds) for t in types)


def _json_type(value) -> str:
    """The JSON Schema type of the JSON value ``value`` (``1.0`` an integer, as JSON Schema has it)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "unknown")


def _resolve(root, ref):
    """The subschema of ``root`` the local reference ``ref`` (``#`` or ``#/a/b``, ``~1`` a slash and
    ``~0`` a tilde) names; None where there is none or it is not local."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _dropped_multiple(schema: dict) -> str:
    """Why xgrammar (0.2.9) would drop the ``multipleOf`` of ``schema`` (an integer's), as the tail
    of :func:`enforceable`'s message; ``""`` where it holds it (a whole number up to
    :data:`MULTIPLE_OF_MAX`, alone or beside a range closed on both sides of at most
    :data:`MULTIPLE_OF_RANGE` integers, exclusive bounds counted as the integers within them) or
    refuses the schema itself (a value or bound not a number, a bound not whole)."""
    m = schema["multipleOf"]
    if not real(m) or m <= 0 or (1 / m).is_integer():  # 1, 0.5, ...: every integer, dropped or not
        return ""
    if m != int(m):
        return " (an integer's must be a whole number)"
    if m > MULTIPLE_OF_MAX:
        return f" above {MULTIPLE_OF_MAX}"
    bounds = {k: schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema}
    if not bounds:
        return ""
    if not all(real(v) and v == int(v) for v in bounds.values()):
        return ""
    lows = [int(bounds[k]) + d for k, d in (("minimum", 0), ("exclusiveMinimum", 1)) if k in bounds]
    highs = [int(bounds[k]) - d for k, d in (("maximum", 0), ("exclusiveMaximum", 1)) if k in bounds]
    if not lows or not highs:
        return f" beside a range open on one side (a closed one of up to {MULTIPLE_OF_RANGE:,} integers holds it)"
    if min(highs) - max(lows) + 1 > MULTIPLE_OF_RANGE:
        return f" beside a range of more than {MULTIPLE_OF_RANGE:,} integers"
    return ""


def string_lengths(schema, param: str = "response_format"):
    """``schema`` with every string's ``minLength``/``maxLength`` written as a ``pattern`` of
    :data:`_PLAIN` characters (a string with a length limit holds no escapes). xgrammar's own length
    limit lets control characters in, and it ignores the limit beside a ``pattern``. A schema of
    several types, one of them ``string`` (a nullable string: ``"type": ["string", "null"]``), is
    held to the same rules: the pattern binds only its strings. Data (``const``,
    ``enum``, ...) is left as it is (:func:`deltafleet.serve.tools.map_schema`).

    Raises:
        InvalidRequestError: a string has both a pattern and a length limit (not supported).
    """
    if isinstance(schema, list):
        return [string_lengths(s, param) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = tools.map_schema(schema, lambda v: string_lengths(v, param))
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "string" in types and ("minLength" in out or "maxLength" in out):
        if "pattern" in out:
            raise InvalidRequestError("a string with both `pattern` and `minLength`/`maxLength` is not supported "
                                      "in structured output", param, "invalid_constraint")
        lo = _length(out.pop("minLength", 0), "minLength", param)
        hi = "" if "maxLength" not in out else _length(out.pop("maxLength"), "maxLength", param)
        out["pattern"] = f"^{_PLAIN}{{{lo},{hi}}}$"
    return out


def _length(v, key: str, param: str):
    """A length limit as an int (JSON Schema counts ``2.0`` a whole number).

    Raises:
        InvalidRequestError: anything but a whole number ≥ 0.
    """
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidRequestError(f"`{key}` must be a whole number ≥ 0, got {v!r}", param, "invalid_constraint")
    return v


@functools.lru_cache(maxsize=64)
def json_grammar(schema: str, strict: bool = True) -> str:
    """The EBNF of the JSON Schema ``schema`` (JSON text): xgrammar's compact grammar (separators
    ``", "`` and ``": "``, no other whitespace; ``strict``: no properties beyond the schema's) with
    its numbers bounded (:func:`bounded_numbers`). Memoized, so a repeated constraint is converted
    once; xgrammar's compiler caches the compiled grammar by this text.

    Raises:
        RuntimeError: xgrammar refuses the schema.
    """
    import xgrammar as xgr

    return bounded_numbers(str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)))


# a rule's name: xgrammar names a $defs entry's rules after its key, "-" and "." kept (defs_a-b.c)
_NAME = r"[\w.-]+"
_RULE = re.compile(rf"({_NAME}) ::= (.+)")
# a token of a rule's body: whitespace, a string literal, a character class, a repetition {n, m} or
# {n}, a name (or Regex / json_string / true of a Regex rule), a punctuation mark
_TOKEN = re.compile(rf'\s+|"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{{\d+(?:, ?-?\d+)?\}}|{_NAME}|[()|*+?,=]')
_ONE_DIGIT = re.compile(r'\[[0-9-]+\]|"[0-9]"')
_UNBOUNDED = re.compile(r"[*+]|\{(\d+), ?-1\}")
_COUNTER = re.compile(rf"({_NAME}_multiple_of_\d+)_mod_\d+")  # a state of an integer's multipleOf automaton
_COUNTER_BODY = re.compile(rf'\((?:""|\("\d" {_NAME}\))(?: \| (?:""|\("\d" {_NAME}\)))*\)')
_COUNTER_STEP = re.compile(rf'\("(\d)" ({_NAME})\)')


def bounded_numbers(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed grammar of a JSON Schema, one ``name ::= body`` a line) with every
    JSON number's digit runs bounded: :data:`INTEGER_DIGITS` before the point, :data:`FRACTION_DIGITS`
    after it, :data:`EXPONENT_DIGITS` in the exponent. The grammar is otherwise the same.

    Two shapes are bounded, wherever they are (plain numbers and integers, ``basic_any``'s numbers,
    the open side of a ``minimum``/``maximum`` range, a number's rules copied for a ``multipleOf``):

    - an unbounded repetition (``*``, ``+``, ``{n, -1}``) of one digit (``[0-9]``, or a rule that is
      just ``[0-9]``): after a ``"."`` it is a fraction, after ``[eE]`` (and the sign's rule) an
      exponent, after one digit the rest of an integer part (``{n, -1}`` becomes ``{n, max(n, 14)}``,
      so a range's least length stands);
    - the states ``<prefix>_multiple_of_<m>_mod_<k>`` of an integer's ``multipleOf`` automaton
      (right-linear, ``"" | "0" state | ...``), entered after the first digit: unrolled into one rule
      per state and digits left (``…_mod_<k>_len<d>``), so a multiple of ``m`` has at most
      :data:`INTEGER_DIGITS` digits. Its grammar grows with ``m`` × :data:`INTEGER_DIGITS` rules, so
      only automata of up to :data:`UNROLL_STATES` states are unrolled; a larger one (xgrammar writes
      it for ``m`` up to 1024) is left as it is, its integer unbounded.

    Bounded ranges, enums and consts are already finite and left as they are; so is what xgrammar
    writes as a ``Regex``. A string ``format`` written in the same shapes (relative-json-pointer's
    leading integer) is bounded alike. The shapes are those of xgrammar 0.2.9;
    tests/test_serve_grammar_numbers.py fails if a number of its grammars is left unbounded.

    Raises:
        ValueError: a line or a token that is not of xgrammar's printed EBNF.
    """
    rules: dict[str, str] = {}
    for line in ebnf.splitlines():
        if line.strip():
            m = _RULE.fullmatch(line)
            if not m or m.group(1) in rules:
                raise ValueError(f"unexpected line in xgrammar's EBNF: {line[:200]!r}")
            rules[m.group(1)] = m.group(2)
    digit_rules = {name for name, body in rules.items() if body == "(([0-9]))"}
    rules = {name: _bound_runs(body, digit_rules) for name, body in rules.items()}
    _bound_counters(rules)
    return "".join(f"{name} ::= {body}\n" for name, body in rules.items())


def _tokens(body: str) -> list[re.Match]:
    """The tokens of a rule's ``body`` (:data:`_TOKEN`, whitespace left out)."""
    out, pos = [], 0
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if not m:
            raise ValueError(f"unexpected text in xgrammar's EBNF: {body[pos:pos + 80]!r}")
        if not m.group().isspace():
            out.append(m)
        pos = m.end()
    return out


def _bound_runs(body: str, digit_rules: set[str]) -> str:
    """``body`` with its unbounded repetitions of one digit bounded by what precedes them (a fraction,
    an exponent or an integer part, :func:`bounded_numbers`); others as they are."""
    toks = _tokens(body)
    for i in range(len(toks) - 1, 0, -1):
        q = _UNBOUNDED.fullmatch(toks[i].group())
        if not q or not (toks[i - 1].group() == "[0-9]" or toks[i - 1].group() in digit_rules):
            continue
        before = [t.group() for t in toks[max(0, i - 3):i - 1]]
        if before[-1:] == ['"."']:
            most = FRACTION_DIGITS
        elif "[eE]" in before:
            most = EXPONENT_DIGITS
        elif before and _ONE_DIGIT.fullmatch(before[-1]):
            most = INTEGER_DIGITS - 1
        else:
            continue
        least = int(q.group(1)) if q.group(1) else int(q.group() == "+")
        body = f"{body[:toks[i].start()]}{{{least}, {max(least, most)}}}{body[toks[i].end():]}"
    return body


def _bound_counters(rules: dict[str, str]) -> None:
    """Unroll each ``multipleOf`` automaton of ``rules`` (in place) into states × digits left
    (:func:`bounded_numbers`). One not of the expected shape, or entered other than after one digit,
    is left as it is."""
    families: dict[str, list[str]] = {}
    for name in rules:
        m = _COUNTER.fullmatch(name)
        if m:
            families.setdefault(m.group(1), []).append(name)
    for members in families.values():
        if len(members) > UNROLL_STATES or not all(_COUNTER_BODY.fullmatch(rules[n]) for n in members):
            continue
        steps = {n: _COUNTER_STEP.findall(rules[n]) for n in members}
        if any(to not in steps for s in steps.values() for _, to in s):
            continue
        fewest = {n: 0 for n in members if rules[n].startswith('("" |') or rules[n] == '("")'}  # digits to an end
        changed = True
        while changed:
            changed = False
            for n, s in steps.items():
                d = min((fewest[to] + 1 for _, to in s if to in fewest), default=None)
                if d is not None and d < fewest.get(n, d + 1):
                    fewest[n], changed = d, True
        entries = {}  # rules outside the automaton that enter it: their tokens and which of them do
        for name, body in rules.items():
            if name not in steps:
                toks = _tokens(body)
                at = [i for i, t in enumerate(toks) if t.group() in steps]
                if at:
                    entries[name] = (toks, at)
        left = INTEGER_DIGITS - 1
        if not entries or any(i == 0 or not _ONE_DIGIT.fullmatch(toks[i - 1].group())
                              or fewest.get(toks[i].group(), left + 1) > left
                              for toks, at in entries.values() for i in at):
            continue
        unrolled, todo = {}, [(toks[i].group(), left) for toks, at in entries.values() for i in at]
        while todo:
            n, d = todo.pop()
            if f"{n}_len{d}" in unrolled:
                continue
            alts = ['""'] if fewest[n] == 0 else []
            for digit, to in steps[n]:
                if fewest.get(to, d) <= d - 1:
                    alts.append(f'("{digit}" {to}_len{d - 1})')
                    todo.append((to, d - 1))
            unrolled[f"{n}_len{d}"] = f"({' | '.join(alts)})"
        if any(n in rules for n in unrolled):
            continue
        for name, (toks, at) in entries.items():
            body = rules[name]
            for i in reversed(at):
                body = f"{body[:toks[i].start()]}{toks[i].group()}_len{left}{body[toks[i].end():]}"
            rules[name] = body
        for n in members:
            del rules[n]
        rules.update(unrolled)
