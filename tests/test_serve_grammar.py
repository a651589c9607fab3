"""Structured output (serve/grammar.py): constraints compiled by xgrammar, applied as token bitmasks
in the batched sampler; through the engine and through the real server with the official OpenAI
client (``response_format``, ``beta.chat.completions.parse``, vLLM's ``guided_*``)."""
from __future__ import annotations

import json
import re

import pydantic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafleet.serve.engine import SamplingParams
from deltafleet.serve.grammar import Grammars, choice_grammar
from deltafleet.serve.request import InvalidRequestError
from deltafleet.serve.sampling import SamplingBatch, request_seed, sample, unpack_bitmask
from tests.conftest import api_error, openai_client_of_server


@pytest.fixture(scope="module")
def grammars(engine) -> Grammars:
    return engine.grammars


def _walk(grammars: Grammars, compiled, seed: int, max_steps: int = 300, temperature: float = 1.0) -> tuple[str, bool]:
    """Sample random logits through the batched sampler under ``compiled``'s bitmask until the grammar
    ends: (the text, whether it ended)."""
    vocab = grammars.vocab_size
    matcher, tokens = grammars.matcher(compiled), []
    g = torch.Generator().manual_seed(seed)
    for pos in range(max_steps):
        bitmask = grammars.bitmask(1)
        matcher.fill_next_token_bitmask(bitmask, 0)
        batch = SamplingBatch.build([(temperature, 1.0, 0, request_seed(seed), pos)], "cpu")
        batch.allowed = bitmask
        token = int(sample(torch.randn(1, vocab, generator=g) * 3, batch)[0])
        assert matcher.accept_token(token), token  # never outside the grammar
        if matcher.is_terminated():
            return grammars.tokenizer.decode(tokens), True
        tokens.append(token)
    return grammars.tokenizer.decode(tokens), False


# ------------------------------------------------------------------------------------ the sampler


def test_the_bitmask_holds_constrained_rows_and_leaves_free_rows_alone():
    """Rows 0 and 2 of four under bitmasks (xgrammar's layout: bit j of word i is token 32·i + j);
    rows 1 and 3 free: they draw what they draw without any bitmask, the others only allowed tokens."""
    vocab = 100
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=g)
    allowed = {0: [3, 40, 99], 2: [64]}
    bitmask = torch.full((4, 4), -1, dtype=torch.int32)  # free rows: every bit set
    for row, toks in allowed.items():
        bitmask[row] = 0
        for t in toks:
            bitmask[row, t // 32] |= (1 << (t % 32)) if t % 32 < 31 else -(1 << 31)
    assert unpack_bitmask(bitmask, vocab)[0].nonzero()[:, 0].tolist() == [3, 40, 99]
    assert unpack_bitmask(bitmask, vocab)[1].all()
    rows = [(t, 1.0, 0, request_seed(i), 7) for i, t in enumerate((1.0, 0.0, 0.7, 1.0))]
    free = sample(logits.clone(), SamplingBatch.build(rows, "cpu"))
    batch = SamplingBatch.build(rows, "cpu")
    batch.allowed = bitmask
    held = sample(logits.clone(), batch)
    assert held[0].item() in allowed[0] and held[2].item() == 64
    assert held[1] == free[1] and held[3] == free[3]


def test_compiled_constraints_are_refused_by_name(grammars):
    with pytest.raises(InvalidRequestError, match="json constraint cannot be compiled") as e:
        grammars.compile("json", '{"type": "object", "properties": {"a": {"type": "no-such-type"}}}', "guided_json")
    assert e.value.param == "guided_json" and e.value.code == "invalid_constraint"
    with pytest.raises(InvalidRequestError, match="regex constraint"):
        grammars.compile("regex", "(unclosed")
    with pytest.raises(InvalidRequestError, match="grammar constraint"):
        grammars.compile("grammar", "root ::= undefined_rule")
    # a grammar no text satisfies compiles, but no token may begin it: refused here, not at generation
    with pytest.raises(InvalidRequestError, match="grammar constraint accepts no text") as e:
        grammars.compile("grammar", "root ::= root", "guided_grammar")
    assert e.value.param == "guided_grammar" and e.value.code == "invalid_constraint"
    grammars.compile("grammar", 'root ::= "" | "a"')  # the empty text is some text: the end may come first
    assert choice_grammar(['say "hi"', "a\\b"]) == r'root ::= "say \"hi\"" | "a\\b"'


SCHEMAS = st.recursive(
    st.one_of(st.just({"type": "boolean"}), st.just({"type": "null"}), st.just({"type": "string", "maxLength": 3}),
              st.lists(st.sampled_from(["red", "green", "a b", "x\"y"]), min_size=1, max_size=3, unique=True)
              .map(lambda v: {"enum": v})),
    lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(["a", "b", "name", "k_2"]), inner, min_size=1, max_size=3)
        .map(lambda p: {"type": "object", "properties": p, "required": sorted(p)}),
        inner.map(lambda i: {"type": "array", "items": i, "minItems": 1, "maxItems": 2})),
    max_leaves=6)


def _conforms(value, schema) -> bool:
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "string":  # U+FFFD: random logits over a byte-level vocabulary can split a character
        return isinstance(value, str) and (len(value) <= schema["maxLength"] or "\ufffd" in value)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "null":
        return value is None
    if kind == "array":
        return isinstance(value, list) and 1 <= len(value) <= 2 and all(_conforms(v, schema["items"]) for v in value)
    return isinstance(value, dict) and set(value) == set(schema["properties"]) and all(
        _conforms(value[k], s) for k, s in schema["properties"].items())


@settings(max_examples=25, deadline=None)
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_sampling_under_a_schema_never_leaves_it(grammars, schema, seed):
    """Random JSON Schemas (enums, booleans, nulls, strings of at most 3 characters, nested objects
    and arrays), random logits: the sampler under the bitmask never draws a token the grammar
    refuses, and what it writes parses (no control character in a string: xgrammar's own maxLength
    lets them in) and conforms to the schema."""
    text, ended = _walk(grammars, grammars.compile("json", json.dumps(schema)), seed)
    assert ended, text
    assert _conforms(json.loads(text), schema), (text, schema)


def test_what_the_library_gets_wrong_is_worked_around_or_refused(grammars):
    """Strings with a length limit become a pattern of plain characters; a pattern beside a length
    limit (which xgrammar would ignore) is refused; properties come out in the schema's order;
    choices keep characters past U+FFFF."""
    for seed in range(6):
        text, ended = _walk(grammars, grammars.compile("json", json.dumps(
            {"type": "object", "properties": {"zed": {"type": "string", "maxLength": 4}, "a": {"type": "boolean"}},
             "required": ["zed", "a"]})), seed)
        assert ended and text.startswith('{"zed": "') and len(json.loads(text)["zed"]) <= 4, text
    with pytest.raises(InvalidRequestError, match="both `pattern` and `minLength`/`maxLength`") as e:
        grammars.compile("json", json.dumps({"type": "string", "pattern": "^a+$", "maxLength": 3}), "guided_json")
    assert e.value.param == "guided_json"
    # found by a reviewer: JSON Schema counts 2.0 a whole number; xgrammar refused its regex
    for seed in range(3):
        text, ended = _walk(grammars, grammars.compile("json", json.dumps({"type": "string", "maxLength": 2.0,
                                                                             "minLength": 1.0})), seed)
        assert ended and 1 <= len(json.loads(text)) <= 2, text
    for bad in (-1, 1.5, "3", "", True):
        with pytest.raises(InvalidRequestError, match=r"^`maxLength` must be a whole number ≥ 0, got ") as e:
            grammars.compile("json", json.dumps({"type": "string", "maxLength": bad}), "guided_json")
        assert e.value.param == "guided_json"
    for seed in range(3):
        text, ended = _walk(grammars, grammars.compile("choice", json.dumps(["😀x", "b"])), seed)
        assert ended and text in ("😀x", "b"), text


def test_a_nullable_string_is_held_to_a_plain_strings_length_rules(grammars):
    """Found by a reviewer: ``"type": ["string", "null"]`` kept xgrammar's own length limit (control
    characters in, ``2.0`` refused, a pattern beside it winning, ``-1`` no limit); it follows the plain
    string's rules now."""
    nullable = {"type": ["string", "null"], "maxLength": 2.0, "minLength": 1}
    compiled = grammars.compile("json", json.dumps(nullable), "guided_json")
    m = grammars.matcher(compiled)
    assert not m.accept_string('"\t')  # a control character: no JSON parser takes it
    m = grammars.matcher(compiled)
    assert m.accept_string('"ab"') and m.is_completed()
    m = grammars.matcher(compiled)
    assert m.accept_string("null") and m.is_completed()
    assert not grammars.matcher(compiled).accept_string('"abc"')
    assert not grammars.matcher(compiled).accept_string('""')
    for seed in range(3):
        text, ended = _walk(grammars, compiled, seed)
        value = json.loads(text)
        assert ended and (value is None or 1 <= len(value) <= 2), text
    with pytest.raises(InvalidRequestError, match="both `pattern` and `minLength`/`maxLength`") as e:
        grammars.compile("json", json.dumps({"type": ["null", "string"], "pattern": "^a+$", "maxLength": 3}),
                         "guided_json")
    assert e.value.param == "guided_json"
    with pytest.raises(InvalidRequestError, match=r"^`maxLength` must be a whole number ≥ 0, got -1"):
        grammars.compile("json", json.dumps({"type": ["string", "null"], "maxLength": -1}))
    # the limit inside anyOf's string branch, as pydantic writes Optional[constr(max_length=2)], holds too
    compiled = grammars.compile("json", json.dumps({"anyOf": [{"type": "string", "maxLength": 2}, {"type": "null"}]}))
    assert not grammars.matcher(compiled).accept_string('"\t')
    assert not grammars.matcher(compiled).accept_string('"abc"')


@pytest.mark.parametrize("schema, keyword, where", [
    ({"type": "integer", "not": {"const": 3}}, "not", "schema.not"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}, "then": {}}, "if",
     "schema.if"),
    ({"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     "uniqueItems", "schema.properties.xs.uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains", "schema.contains"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     "dependentRequired", "schema.dependentRequired"),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]}, "allOf",
     "schema.allOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [{"required": ["a"]}]}, "allOf",
     "schema.allOf"),
    ({"$defs": {"P": {"anyOf": [{"type": "null"}, {"type": "integer", "not": {"const": 0}}]}}, "$ref": "#/$defs/P"},
     "not", "schema.$defs.P.anyOf.1.not"),
    # found by a fresh user: 2.30 under multipleOf 0.5, free text under a remote $ref, and {"x": 1, "x": 2}
    ({"type": "object", "properties": {"v": {"type": "number", "multipleOf": 0.5}}}, "multipleOf",
     "schema.properties.v.multipleOf"),
    ({"$ref": "http://127.0.0.1:1/x.json"}, "$ref", "schema.$ref"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "$ref", "schema.properties.a.$ref"),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}, "minProperties": 1}, "patternProperties",
     "schema.patternProperties"),
    # a format xgrammar writes (email, date, ...) wins over a length limit or a pattern beside it
    ({"type": "object", "properties": {"to": {"type": "string", "format": "email", "maxLength": 3}}}, "maxLength",
     "schema.properties.to.maxLength"),
    ({"type": "string", "format": "date", "minLength": 20}, "minLength", "schema.minLength"),
    ({"type": ["string", "null"], "format": "date", "pattern": "^2"}, "pattern", "schema.pattern"),
    # xgrammar writes only the branches of anyOf/oneOf: a length limit beside them went unheld
    ({"anyOf": [{"type": "string"}, {"type": "null"}], "maxLength": 5}, "maxLength", "schema.maxLength"),
    ({"type": "object", "properties": {"n": {"oneOf": [{"type": "string"}, {"type": "null"}], "minLength": 2}}},
     "minLength", "schema.properties.n.minLength"),
    # and so every other constraint beside them: {"b": 1} and {} passed the first, "x" the second
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "anyOf": [{"type": "object"}, {"type": "object"}]}, "properties", "schema.properties"),
    # a type is refused where a branch lets other values through (null; a number; any value; the enum's 1)
    ({"type": "object", "anyOf": [{"$ref": "#/$defs/A"}, {"type": "null"}],
      "$defs": {"A": {"type": "object", "properties": {"a": {"type": "integer"}}}}}, "type", "schema.type"),
    ({"type": "integer", "oneOf": [{"type": "integer"}, {"type": "number"}]}, "type", "schema.type"),
    ({"type": "string", "anyOf": [{"minLength": 1}, {"format": "date"}]}, "type", "schema.type"),
    ({"type": "string", "enum": ["a", 1], "anyOf": [{"type": "string"}, {"type": "integer"}]}, "type",
     "schema.type"),
    ({"type": "object", "oneOf": [{"$ref": "#/$defs/missing"}]}, "type", "schema.type"),
    ({"anyOf": [{"required": ["a"]}, {"required": ["b"]}], "properties": {"a": {"type": "integer"}}}, "properties",
     "schema.properties"),
    ({"anyOf": [{"type": "array"}, {"type": "null"}], "items": {"type": "integer"}}, "items", "schema.items"),
    ({"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "null"}], "minimum": 3}}},
     "minimum", "schema.properties.n.minimum"),
    ({"anyOf": [{"type": "string"}, {"type": "null"}], "format": "date"}, "format", "schema.format"),
    # found by a reviewer: beside anyOf, a oneOf is dropped ("a" passed, valid only as an integer)
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "oneOf": [{"type": "integer"}, {"type": "boolean"}]},
     "oneOf", "schema.oneOf"),
    ({"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}], "oneOf": [{"type": "integer"}]}}},
     "oneOf", "schema.properties.v.oneOf"),
    # and beside a $ref the branches are (the reference is followed alone: true passed)
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "$ref": "#/$defs/B", "$defs": {"B": {"type": "boolean"}}},
     "anyOf", "schema.anyOf"),
    ({"oneOf": [{"type": "integer"}], "$ref": "#/$defs/B", "$defs": {"B": {"type": "boolean"}}}, "oneOf",
     "schema.oneOf"),
    # beside a $ref, every assertion, enum and const is (the reference is followed alone: 1, {} and 2 passed)
    ({"type": "object", "properties": {"n": {"$ref": "#/$defs/I", "minimum": 5}}, "$defs": {"I": {"type": "integer"}}},
     "minimum", "schema.properties.n.minimum"),
    ({"$ref": "#/$defs/O", "required": ["a"], "$defs": {"O": {"type": "object"}}}, "required", "schema.required"),
    ({"$ref": "#/$defs/I", "enum": [1], "$defs": {"I": {"type": "integer"}}}, "enum", "schema.enum"),
    ({"$ref": "#/$defs/I", "type": "string", "$defs": {"I": {"type": "integer"}}}, "type", "schema.type"),
    # found by a reviewer: xgrammar drops an integer's multipleOf beside a range open on one side (pydantic's
    # Field(ge=0, multiple_of=5): 6 passed) or of more than 10,000 integers, above 1024, or not whole
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "multipleOf": 5}}}, "multipleOf",
     "schema.properties.n.multipleOf"),
    ({"type": "integer", "exclusiveMaximum": 100, "multipleOf": 5}, "multipleOf", "schema.multipleOf"),
    ({"type": "integer", "minimum": 0, "maximum": 10000, "multipleOf": 3}, "multipleOf", "schema.multipleOf"),
    ({"type": "integer", "multipleOf": 1025}, "multipleOf", "schema.multipleOf"),
    ({"type": "integer", "multipleOf": 2.5}, "multipleOf", "schema.multipleOf"),
])
def test_keywords_the_library_would_ignore_are_refused_by_name(grammars, schema, keyword, where):
    """xgrammar 0.2.9 compiles these schemas but does not hold the output to the keyword (for the
    first, "3" would pass): a 400 naming the keyword and where it sits, not a grammar that lets the
    output break the schema."""
    with pytest.raises(InvalidRequestError, match=f"`{re.escape(keyword)}` \\(at {re.escape(where)}\\.?") as e:
        grammars.compile("json", json.dumps(schema), "guided_json")
    assert e.value.param == "guided_json" and e.value.code == "invalid_constraint"


def test_a_type_beside_branches_that_name_one_reference_reads_it_once(monkeypatch):
    """Found by a reviewer: reading the types a union writes followed each branch's reference anew,
    so branches naming one reference doubled the work at each level: ``{"type": "object", "anyOf":
    [{"$ref": "#"}, {"$ref": "#"}]}`` took 2⁶⁴ calls and held a request's thread for good (a
    tool's parameters as much as a response_format). Each reference is now read once per check."""
    from deltafleet.serve import grammar

    resolved = []
    real_resolve = grammar._resolve
    monkeypatch.setattr(grammar, "_resolve", lambda root, ref: resolved.append(ref) or real_resolve(root, ref))
    chain = {f"A{i}": {"anyOf": [{"$ref": f"#/$defs/A{i + 1}"}, {"$ref": f"#/$defs/A{i + 1}"}]} for i in range(20)}
    chain["A20"] = {"type": "object"}
    schema = {"type": "object", "anyOf": [{"$ref": "#/$defs/A0"}, {"$ref": "#/$defs/A0"}], "$defs": chain}
    grammar.enforceable(schema)  # every branch an object: the type is taken
    refs = 2 + 2 * (len(chain) - 1)  # the $ref nodes: two in the root, two in each of A0..A19
    # each $ref node resolved once (does it name something?), each of A0..A20 read once for its types:
    # not 2²¹ reads
    assert len(resolved) == refs + len(chain), len(resolved)
    for cycle in ({"type": "object", "anyOf": [{"$ref": "#"}, {"$ref": "#"}]},
                  {"type": "object", "oneOf": [{"$ref": "#/$defs/A"}, {"type": "object"}],
                   "$defs": {"A": {"anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#"}]}}}):
        with pytest.raises(InvalidRequestError, match=r"`type` \(at schema\.type\)"):
            grammar.enforceable(cycle)  # a cycle writes nothing known: the type is refused, at once


def test_a_reference_to_nothing_is_refused_where_it_is(grammars):
    """Found by a reviewer: a tool's ``$ref`` to nothing got xgrammar's message about the call
    schema's internal path (``#/$defs/tool_f/$defs/Missing``), and an anchor (``#foo``) was rebased
    into one; now any local reference that names nothing is a 400 naming it and its place."""
    for ref in ("#/$defs/Missing", "#foo", "#/properties/b/items"):
        schema = {"type": "object", "properties": {"a": {"$ref": ref}, "b": {"type": "string"}}}
        with pytest.raises(InvalidRequestError, match=rf"`\$ref` \(at schema\.properties\.a\.\$ref\).*"
                                                       rf"{re.escape(repr(ref))} names nothing") as e:
            grammars.compile("json", json.dumps(schema), "response_format")
        assert e.value.code == "invalid_constraint"
    ok = {"type": "object", "properties": {"a": {"$ref": "#/properties/b"}, "b": {"type": "string"}},
          "$defs": {"a/b~c": {"type": "integer"}}, "required": ["a"]}
    grammars.compile("json", json.dumps(ok | {"properties": {**ok["properties"], "c": {"$ref": "#/$defs/a~1b~0c"}}}),
                     "response_format")  # a pointer's ~1 and ~0 resolve


def test_what_the_library_holds_is_still_taken(grammars):
    """A property that happens to be called ``not``, ``uniqueItems: false``, and one ``allOf``
    subschema beside annotations and ``$defs`` (as pydantic writes a described model field) compile,
    and the last holds the output to its subschema; so does a length limit beside a ``format``
    xgrammar does not write."""
    grammars.compile("json", json.dumps({"type": "object", "properties": {"not": {"type": "integer"}, "if": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": False}}, "required": ["not"]}))
    one = {"allOf": [{"$ref": "#/$defs/A"}], "description": "a number", "$defs": {"A": {"type": "integer"}}}
    for seed in range(3):
        text, ended = _walk(grammars, grammars.compile("json", json.dumps(one)), seed)
        assert ended and isinstance(json.loads(text), int), text
    # enum and const beside anyOf hold (xgrammar writes them instead of the branches); annotations and
    # keywords outside JSON Schema (OpenAPI's discriminator, an extension) constrain nothing
    kinds = {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                       {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}],
             "discriminator": {"propertyName": "k"}, "title": "Kind", "description": "a or b", "x-order": 1}
    enum = {"anyOf": [{"type": "integer"}, {"type": "string"}], "enum": [1, "a"], "default": 1}
    for schema, ok in ((kinds, lambda v: v["k"] in ("a", "b")), (enum, lambda v: v in (1, "a"))):
        for seed in range(3):
            text, ended = _walk(grammars, grammars.compile("json", json.dumps(schema)), seed)
            assert ended and ok(json.loads(text)), text
    # an integer's multipleOf holds alone (a whole number, 4.0 too) and beside a closed range of up to 10,000
    # integers
    for n, ok in (({"type": "integer", "multipleOf": 4.0}, lambda v: v % 4 == 0),
                  ({"type": "integer", "exclusiveMinimum": -1, "maximum": 9999, "multipleOf": 7},
                   lambda v: v % 7 == 0 and 0 <= v <= 9999)):
        compiled = grammars.compile("json", json.dumps({"type": "object", "properties": {"n": n}, "required": ["n"]}))
        assert not grammars.matcher(compiled).accept_string('{"n": 15}')
        for seed in range(3):
            text, ended = _walk(grammars, compiled, seed)
            assert ended and ok(json.loads(text)["n"]), text
    # a type beside a union whose every branch is of it already (OpenAPI's polymorphic object, a nullable
    # date) is taken: the branches hold it (found by a reviewer: a 400 since 44a9ac1)
    pets = {"type": "object", "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/definitions/Dog"}],
            "discriminator": {"propertyName": "kind"},
            "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
                      "Dog/x": {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}},
            "definitions": {"Dog": {"allOf": [{"$ref": "#/$defs/Dog~1x"}], "title": "Dog"}}}
    ref = {"type": "object", "$ref": "#/$defs/O", "description": "an o", "$defs": {"O": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    when = {"type": ["string", "null"], "anyOf": [{"type": "string", "format": "date"}, {"enum": [None]}]}
    num = {"type": "number", "anyOf": [{"type": "integer", "minimum": 5}, {"const": 0.5}]}
    for schema, ok in ((pets, lambda v: v["kind"] in ("cat", "dog")), (ref, lambda v: isinstance(v["a"], int)),
                       (when, lambda v: v is None or v[4] == "-"), (num, lambda v: v == 0.5 or (isinstance(v, int) and v >= 5))):
        for seed in range(3):
            text, ended = _walk(grammars, grammars.compile("json", json.dumps(schema)), seed)
            assert ended and ok(json.loads(text)), text
    # a format xgrammar does not write leaves the length limit to hold
    free = {"type": "string", "format": "password", "maxLength": 3}
    for seed in range(3):
        text, ended = _walk(grammars, grammars.compile("json", json.dumps(free)), seed)
        assert ended and len(json.loads(text)) <= 3, text



def test_values_that_look_like_schemas_are_left_as_they_are(grammars):
    """A ``const`` or ``enum`` value is data: one that looks like a string schema with a length limit
    is written as it is, not rewritten to a pattern (found: the grammar held the output to the
    rewritten value); a property named ``const`` is still a schema, its length still a pattern."""
    schema = {"type": "object", "properties": {
        "k": {"const": {"type": "string", "maxLength": 2}}, "e": {"enum": [{"type": "string", "minLength": 1}]},
        "const": {"type": "string", "maxLength": 1}}, "required": ["k", "e", "const"]}
    text, ended = _walk(grammars, grammars.compile("json", json.dumps(schema)), 0)
    assert ended, text
    value = json.loads(text)
    assert (value["k"], value["e"]) == ({"type": "string", "maxLength": 2}, {"type": "string", "minLength": 1}), text
    assert len(value["const"]) <= 1 and not any(c in value["const"] for c in '"\\\n'), text

def test_regex_choice_and_any_object(grammars):
    text, ended = _walk(grammars, grammars.compile("regex", "[0-9]{3}-(yes|no)"), 1)
    assert ended and len(text) in (6, 7) and text[:3].isdigit() and text[4:] in ("yes", "no")
    for seed in range(3):
        text, ended = _walk(grammars, grammars.compile("choice", json.dumps(["left", "right", "up"])), seed)
        assert ended and text in ("left", "right", "up")
    text, ended = _walk(grammars, grammars.compile("json_object", None), 2, temperature=0.0)
    if ended:  # greedy random logits may also keep a string open to the step limit
        assert isinstance(json.loads(text), dict)


@pytest.mark.gpu
def test_the_pinned_bitmask_is_one_reused_buffer_filled_as_a_fresh_one(grammars):
    if not torch.cuda.is_available():
        pytest.skip("page-locked memory needs CUDA")
    compiled = grammars.compile("regex", "[a-c]+")
    matchers = [grammars.matcher(compiled) for _ in range(5)]
    fresh = grammars.bitmask(5)
    grammars.fill(matchers, fresh)
    first = grammars.bitmask(3, pinned=True)
    first.fill_(0)
    pinned = grammars.bitmask(5, pinned=True)
    assert pinned.is_pinned() and pinned.data_ptr() == first.data_ptr() and pinned.shape == fresh.shape
    pinned = grammars.bitmask(5, pinned=True)  # all allowed again
    grammars.fill(matchers[:2], pinned, [1, 3])  # rows 1 and 3 held, the others free
    assert torch.equal(pinned[[1, 3]], fresh[:2]) and (pinned[[0, 2, 4]] == -1).all()
    # the sampler's mask on the GPU (one compiled kernel) keeps what the CPU's keeps
    logits = torch.randn(5, grammars.vocab_size, generator=torch.Generator().manual_seed(3))
    rows = [(t, 1.0, 0, request_seed(i), 9) for i, t in enumerate((0.0, 1.0, 0.0, 1.0, 0.7))]
    on = {}
    for dev in ("cpu", "cuda"):
        batch = SamplingBatch.build(rows, dev)
        batch.allowed = pinned.to(dev, non_blocking=True)
        on[dev] = sample(logits.to(dev), batch).cpu()
    assert torch.equal(on["cpu"], on["cuda"])
    allowed = unpack_bitmask(pinned, grammars.vocab_size)
    assert allowed[1, on["cpu"][1]] and allowed[3, on["cpu"][3]] and not allowed[1].all()


# ------------------------------------------------------------------------------------ the engine


SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
          "required": ["answer", "sure"]}


def test_constrained_and_free_requests_of_different_variants_share_steps(engine):
    """Constrained requests on the base and on a variant beside free ones: the constrained outputs
    parse and conform; the free ones equal their outputs alone."""
    constraint = ("json", json.dumps(SCHEMA))
    free = {m: engine.complete(m, "The quick brown", SamplingParams(max_tokens=12, temperature=0))
            for m in ("tiny", "tiny-writer")}
    import threading

    got = {}

    def run(key, model, params):
        got[key] = engine.complete(model, "The quick brown", params)

    jobs = [("c-tiny", "tiny", SamplingParams(max_tokens=64, temperature=0.8, seed=1, constraint=constraint)),
            ("c-coder", "tiny-coder", SamplingParams(max_tokens=64, temperature=0, constraint=constraint)),
            ("f-tiny", "tiny", SamplingParams(max_tokens=12, temperature=0)),
            ("f-writer", "tiny-writer", SamplingParams(max_tokens=12, temperature=0))]
    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for key in ("c-tiny", "c-coder"):
        assert got[key].finish_reason == "stop", got[key]
        value = json.loads(got[key].text)
        assert value["answer"] in ("yes", "no", "maybe") and isinstance(value["sure"], bool)
    assert got["f-tiny"].text == free["tiny"].text and got["f-writer"].text == free["tiny-writer"].text
    # min_tokens does not hold back a grammar's end (the grammar then allows only eos)
    held = engine.complete("tiny", "Hi", SamplingParams(max_tokens=20, min_tokens=8, temperature=0,
                                                         constraint=("choice", '["yes", "no"]')))
    assert held.finish_reason == "stop" and held.text in ("yes", "no")


# ------------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def client(tiny_family, tmp_path_factory):
    yield from openai_client_of_server(tiny_family.root, tmp_path_factory.mktemp("grammar_server"))


class Verdict(pydantic.BaseModel):
    answer: str
    sure: bool


MESSAGES = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]


def test_response_format_json_schema_and_parse_through_the_openai_client(client):
    for model in ("tiny", "tiny-coder"):
        r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=64, temperature=0,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "verdict", "schema": SCHEMA, "strict": True}})
        value = json.loads(r.choices[0].message.content)
        assert value["answer"] in ("yes", "no", "maybe") and isinstance(value["sure"], bool)
        assert r.choices[0].finish_reason == "stop"
    parsed = client.beta.chat.completions.parse(model="tiny-writer", messages=MESSAGES, max_tokens=96,
                                                temperature=0.7, seed=3, response_format=Verdict)
    assert isinstance(parsed.choices[0].message.parsed, Verdict)


def test_guided_fields_and_streaming(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0.9, seed=5,
                                       extra_body={"guided_choice": ["sunny", "rainy"]})
    assert r.choices[0].message.content in ("sunny", "rainy")
    r = client.completions.create(model="tiny-coder", prompt="Code: ", max_tokens=16, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}})
    assert len(r.choices[0].text) == 4 and r.choices[0].text[:2].isupper() and r.choices[0].text[2:].isdigit()
    stream = client.chat.completions.create(model="tiny-writer", messages=MESSAGES, max_tokens=64, temperature=0,
                                            stream=True, extra_body={"guided_json": SCHEMA})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert json.loads(text)["answer"] in ("yes", "no", "maybe")


def test_bad_constraints_are_400s_that_name_the_field(client):
    import httpx

    url = str(client.base_url)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}
    r = httpx.post(f"{url}chat/completions", json=body | {"guided_json": {"type": "object", "properties": {
        "a": {"type": "no-such-type"}}}}, timeout=30)
    assert api_error(r, 400)["param"] == "guided_json"
    r = httpx.post(f"{url}chat/completions", json=body | {"guided_regex": "a+", "guided_choice": ["a"]}, timeout=30)
    err = api_error(r, 400)
    assert "only one structured-output constraint" in err["message"] and err["param"] == "guided_choice"
    r = httpx.post(f"{url}chat/completions", json=body | {"response_format": {"type": "json_schema"}}, timeout=30)
    assert api_error(r, 400)["param"] == "response_format"
    r = httpx.post(f"{url}chat/completions", json=body | {"guided_decoding_backend": "outlines"}, timeout=30)
    assert api_error(r, 400)["param"] == "guided_decoding_backend"
    deep = '{"type": "array", "items": ' * 3000 + "{}" + "}" * 3000  # under the size limit, past json's depth
    err = api_error(httpx.post(f"{url}completions", json={"model": "tiny", "prompt": "x", "guided_json": deep},
                               timeout=30), 400)
    assert err["param"] == "guided_json" and "nested too deeply" in err["message"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [{"required": ["a"]}]}
    for fmt, param, what in (({"name": "x", "schema": schema}, "response_format", "`allOf` (at schema.allOf)"),
                             ({"name": "x", "schema": {}, "strict": "yes"}, "response_format", "strict"),
                             ({"name": "bad name!", "schema": {}}, "response_format", "name")):
        err = api_error(httpx.post(f"{url}chat/completions", json=body | {
            "response_format": {"type": "json_schema", "json_schema": fmt}}, timeout=30), 400)
        assert err["param"].startswith(param) and what in err["message"], err
    assert client.models.list().data  # and the server goes on
