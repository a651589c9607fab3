"""Structured output's numbers (serve/grammar.py, ``bounded_numbers``): every JSON number a grammar
writes has at most ``INTEGER_DIGITS`` digits before the point, ``FRACTION_DIGITS`` after it and
``EXPONENT_DIGITS`` in the exponent, wherever it sits (schemas, ``$defs``, arrays, ``anyOf``, any
JSON object, a tool call's arguments), with xgrammar's ranges, ``multipleOf``, enums and consts kept;
a model that keeps writing digits is made to stop."""
from __future__ import annotations

import json
import re

import pytest
import torch

from deltafleet.serve.grammar import (EXPONENT_DIGITS, FRACTION_DIGITS, INTEGER_DIGITS, Grammars, bounded_numbers,
                                      json_grammar)
from deltafleet.serve.sampling import SamplingBatch, request_seed, sample


@pytest.fixture(scope="module")
def grammars(tiny_family) -> Grammars:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_family.base_dir)
    return Grammars(tok, len(tok))


def _obj(**props) -> str:
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def _accepts(grammars: Grammars, compiled, text: str) -> bool:
    """Whether ``text`` is a whole output of ``compiled`` (the matcher takes it and may then end)."""
    m = grammars.matcher(compiled)
    return m.accept_string(text) and m.accept_token(grammars.tokenizer.eos_token_id) and m.is_terminated()


TYPICAL = ["0", "-3.25", "1e-7", "123456789012345", "6.02e23", "-0.5E+12", "0.30000000000000004", "1.5e308"]
TOO_LONG = ["1" * (INTEGER_DIGITS + 1), "-" + "9" * (INTEGER_DIGITS + 1) + ".5",
            "0." + "3" * (FRACTION_DIGITS + 1), "1.25" + "0" * FRACTION_DIGITS + "1",
            "1e" + "1" * (EXPONENT_DIGITS + 1), "2.5E-" + "0" * (EXPONENT_DIGITS + 1)]
TYPICAL_INT = ["0", "-7", "42", "123456789012345", "-999999999999999"]
TOO_LONG_INT = ["1" * (INTEGER_DIGITS + 1), "-" + "1" * (INTEGER_DIGITS + 1), "1" * 40]

CALL_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}]

# (kind, spec, the whole output with the value v in it, typical values, values too long)
PLACES = {
    "number": ("json", _obj(x={"type": "number"}), '{{"x": {}}}', TYPICAL, TOO_LONG),
    "integer": ("json", _obj(i={"type": "integer"}), '{{"i": {}}}', TYPICAL_INT, TOO_LONG_INT),
    "array": ("json", _obj(xs={"type": "array", "items": {"type": "number"}}), '{{"xs": [1, {}]}}', TYPICAL, TOO_LONG),
    "$defs": ("json", json.dumps({"type": "object", "$defs": {"P": {
        "type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}, "required": ["n", "x"]}},
        "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"]}), '{{"p": {{"n": 3, "x": {}}}}}', TYPICAL,
        TOO_LONG),
    "anyOf": ("json", _obj(u={"anyOf": [{"type": "number"}, {"type": "null"}]}), '{{"u": {}}}', TYPICAL, TOO_LONG),
    "json_object": ("json_object", None, '{{"a": {{"b": [true, {}]}}}}', TYPICAL, TOO_LONG),
    "tool_call": ("tool_call", json.dumps({"tools": CALL_TOOLS, "name": None}),
                  '<tool_call>{{"name": "f", "arguments": {{"x": {}}}}}</tool_call>', TYPICAL, TOO_LONG),
}


@pytest.mark.parametrize("place", list(PLACES))
def test_numbers_are_bounded_wherever_they_are(grammars, place):
    kind, spec, text, typical, too_long = PLACES[place]
    compiled = grammars.compile(kind, spec)
    for v in typical:
        assert _accepts(grammars, compiled, text.format(v)), (place, v)
        json.loads(text.format(v).removeprefix("<tool_call>").removesuffix("</tool_call>"))
    for v in too_long:
        assert not _accepts(grammars, compiled, text.format(v)), (place, v)


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer", "minimum": 12345}, ["12345", "123456789012345"], ["12344", "-1", "1234567890123456"]),
    ({"type": "integer", "exclusiveMaximum": 5}, ["4", "-123456789012345"], ["5", "-1234567890123456"]),
    ({"type": "number", "minimum": 0}, ["0", "2.5", "123456789012345.125"], ["-1", "1234567890123456"]),
    ({"type": "number", "exclusiveMaximum": 2.5}, ["2.4", "-3", "-123456789012345.5"], ["2.5", "-1234567890123456"]),
    ({"type": "number", "minimum": 0, "maximum": 10}, ["0", "9.5", "10"], ["10.5", "-0.5"]),
    ({"type": "integer", "multipleOf": 3}, ["0", "-3", "999999999999999"], ["4", "1000000000000002"]),
    ({"type": "integer", "multipleOf": 7}, ["14", "-7", "999999999999994"], ["15", "1000000000000001"]),
    # past UNROLL_STATES the automaton stays as xgrammar writes it: multiples held, length not
    ({"type": "integer", "multipleOf": 1000}, ["-3000", "999999999999000", "1000000000000000"], ["3001"]),
    ({"enum": [1, 2.5, "a"]}, ["1", "2.5", '"a"'], ["3", "25"]),
    ({"const": 123456789}, ["123456789"], ["12345678", "1234567890"]),
])
def test_ranges_multiples_enums_and_consts_stand_with_the_bound(grammars, schema, good, bad):
    """What xgrammar encodes of a number (the range, an integer's ``multipleOf``, enums and consts)
    still holds, and an open side of a range is bounded like a plain number."""
    compiled = grammars.compile("json", _obj(v=schema))
    for v in good:
        assert _accepts(grammars, compiled, f'{{"v": {v}}}'), (schema, v)
    for v in bad:
        assert not _accepts(grammars, compiled, f'{{"v": {v}}}'), (schema, v)


def _digits(grammars: Grammars) -> list[int]:
    """Ids of the tokens that begin with a digit."""
    return [i for i in range(len(grammars.tokenizer)) if grammars.tokenizer.decode([i])[:1].isdigit()]


def _allowed(grammars: Grammars, matcher) -> set[int]:
    bitmask = grammars.bitmask(1)
    matcher.fill_next_token_bitmask(bitmask, 0)
    bits = bitmask[0].view(torch.uint8).numpy()
    return {i for i in range(grammars.vocab_size) if bits[i // 8] >> (i % 8) & 1}


@pytest.mark.parametrize("prefix, run, bound", [
    ('{"x": ', "7", INTEGER_DIGITS), ('{"x": -', "7", INTEGER_DIGITS), ('{"x": 1.', "2", FRACTION_DIGITS),
    ('{"x": 6.02e', "2", EXPONENT_DIGITS), ('{"x": 6e-', "0", EXPONENT_DIGITS)],
    ids=["integer", "negative", "fraction", "exponent", "negative-exponent"])
def test_a_run_of_digits_is_cut_at_the_bound(grammars, prefix, run, bound):
    """The allowed tokens hold digits until the run reaches its bound, and none after."""
    digits = set(_digits(grammars))
    m = grammars.matcher(grammars.compile("json", _obj(x={"type": "number"})))
    assert m.accept_string(prefix)
    for n in range(bound):
        assert _allowed(grammars, m) & digits, n
        assert m.accept_string(run)
    assert not _allowed(grammars, m) & digits
    assert not m.accept_string(run)


@pytest.mark.parametrize("kind, spec, prefix", [("json", _obj(x={"type": "number"}), '{"x": '),
                                                ("json", _obj(n={"type": "integer"}), '{"n": '),
                                                ("json_object", None, '{"a": ')],
                         ids=["number", "integer", "json_object"])
def test_a_model_that_keeps_writing_digits_is_made_to_stop(grammars, kind, spec, prefix):
    """Greedy logits that rank a digit above everything (``1`` first, then ``.``, ``e``, ``}``) from
    a number's first character on, through the sampler under the bitmask: the output still ends and
    parses, each digit run as long as its bound lets it be."""
    tok, vocab = grammars.tokenizer, grammars.vocab_size
    logits = torch.zeros(vocab)
    for first, score in (("}", 2.0), ("e", 5.0), (".", 6.0), ("0123456789", 10.0), ("1", 11.0)):
        logits[[i for i in range(len(tok)) if tok.decode([i])[:1] and tok.decode([i])[0] in first]] = score
    matcher, tokens = grammars.matcher(grammars.compile(kind, spec)), []
    assert matcher.accept_string(prefix)
    for pos in range(200):
        bitmask = grammars.bitmask(1)
        matcher.fill_next_token_bitmask(bitmask, 0)
        batch = SamplingBatch.build([(0.0, 1.0, 0, request_seed(0), pos)], "cpu")
        batch.allowed = bitmask
        token = int(sample(logits.clone()[None], batch)[0])
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            break
        tokens.append(token)
    text = prefix + tok.decode(tokens)
    assert matcher.is_terminated(), text
    json.loads(text)
    runs = re.fullmatch(r'\{"\w": (\d+)(?:\.(\d+))?(?:e(\d+))?}', text)
    assert runs, text
    integer = "integer" in (spec or "")
    expect = (INTEGER_DIGITS, None, None) if integer else (INTEGER_DIGITS, FRACTION_DIGITS, EXPONENT_DIGITS)
    assert tuple(g and len(g) for g in runs.groups()) == expect, text


SCHEMAS = [
    {"type": "number"}, {"type": "integer"}, {"type": "number", "minimum": 0}, {"type": "number", "maximum": -2.5},
    {"type": "integer", "exclusiveMinimum": 3}, {"type": "integer", "maximum": 5},
    {"type": "integer", "minimum": 10**16},
    {"type": "integer", "multipleOf": 3}, {"type": "integer", "multipleOf": 12, "minimum": -5},
    {"type": "number", "multipleOf": 0.25}, {"type": ["number", "string"]},
    {"type": "array", "items": {"type": "integer"}, "prefixItems": [{"type": "number"}]},
    {"type": "object", "additionalProperties": {"type": "number"}}, {"type": "object"},
]
_DIGIT_RULE = re.compile(r"^(\w+) ::= \(\(\[0-9\]\)\)$", re.M)


def _unbounded_runs(ebnf: str) -> list[str]:
    """Lines of ``ebnf`` with an unbounded repetition of a digit, or a multipleOf automaton not unrolled."""
    digit = "|".join([r"\[0-9\]"] + [re.escape(n) for n in _DIGIT_RULE.findall(ebnf)])
    run = re.compile(rf"(?:{digit})(?:\*|\+|\{{\d+, -1\}})|_multiple_of_\d+_mod_\d+ ")
    return [line for line in ebnf.splitlines() if run.search(line)]


@pytest.mark.parametrize("schema", SCHEMAS, ids=json.dumps)
def test_no_number_of_xgrammars_grammars_is_left_unbounded(schema):
    """xgrammar's grammar of each schema has unbounded digit runs (the shapes bounded_numbers knows,
    as xgrammar 0.2.9 prints them); the bounded one has none. Fails if xgrammar changes how it
    writes numbers."""
    import xgrammar as xgr

    text = json.dumps({"type": "object", "properties": {"v": schema}, "required": ["v"]})
    raw = str(xgr.Grammar.from_json_schema(text, any_whitespace=False))
    assert _unbounded_runs(raw), raw
    assert not _unbounded_runs(json_grammar(text)), json_grammar(text)
    assert not _unbounded_runs(json_grammar(json.dumps(schema), strict=False))


def test_xgrammars_plain_number_is_the_one_bounded():
    """The rules of a plain JSON number as xgrammar 0.2.9 writes them, and as they are bounded."""
    import xgrammar as xgr

    raw = str(xgr.Grammar.from_json_schema('{"type": "number"}', any_whitespace=False))
    for rule in ('basic_number ::= ((basic_number_1 basic_number_2 basic_number_3 basic_number_5))',
                 'basic_number_2 ::= (("0") | ([1-9] [0-9]*))',
                 'basic_number_3 ::= ("" | ("." basic_number_digits{1, -1}))',
                 'basic_number_5 ::= ("" | ([eE] basic_number_4 basic_number_digits{1, -1}))',
                 'basic_integer ::= (("0") | (basic_integer_1 [1-9] [0-9]*))'):
        assert rule in raw.splitlines(), (rule, raw)
    bounded = bounded_numbers(raw).splitlines()
    assert f'basic_number_2 ::= (("0") | ([1-9] [0-9]{{0, {INTEGER_DIGITS - 1}}}))' in bounded
    assert f'basic_number_3 ::= ("" | ("." basic_number_digits{{1, {FRACTION_DIGITS}}}))' in bounded
    assert f'basic_number_5 ::= ("" | ([eE] basic_number_4 basic_number_digits{{1, {EXPONENT_DIGITS}}}))' in bounded
    with pytest.raises(ValueError, match="unexpected"):
        bounded_numbers(raw + "not a rule\n")


def test_a_constraint_is_converted_and_compiled_once(grammars):
    """The same constraint twice: the EBNF is built once (json_grammar's memo) and xgrammar's cache,
    keyed by that text, does not grow."""
    spec = _obj(once={"type": "number"}, n={"type": "integer", "multipleOf": 5})
    grammars.compile("json", spec)
    hits, size = json_grammar.cache_info().hits, grammars._get_compiler().get_cache_size_bytes()
    grammars.compile("json", spec)
    assert json_grammar.cache_info().hits == hits + 1
    assert grammars._get_compiler().get_cache_size_bytes() == size


def test_a_large_multiple_of_is_not_unrolled():
    """An integer multipleOf automaton past UNROLL_STATES is left as xgrammar writes it: the grammar
    stays about xgrammar's size (unrolled, 1,000 states would be some 15,000 rules)."""
    import xgrammar as xgr

    text = json.dumps({"type": "object", "properties": {f"v{i}": {"type": "integer", "multipleOf": 1000 + i}
                                                        for i in range(4)}})
    raw = str(xgr.Grammar.from_json_schema(text, any_whitespace=False))
    assert len(json_grammar(text)) < 1.1 * len(raw)
    small = json.dumps({"type": "object", "properties": {"v": {"type": "integer", "multipleOf": 7}}})
    assert not _unbounded_runs(json_grammar(small))


def test_a_defs_name_with_a_dash_or_a_dot_is_bounded_too(grammars):
    """xgrammar names a ``$defs`` entry's rules after its key with ``-`` and ``.`` kept
    (``defs_p-q.r``): such a schema is taken and its numbers bounded as any others, an integer's
    ``multipleOf`` too (found: it was a 400, "unexpected line in xgrammar's EBNF")."""
    schema = json.dumps({"type": "object", "$defs": {"p-q.r": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}, "x": {"type": "number"}},
        "required": ["n", "x"]}}, "properties": {"p": {"$ref": "#/$defs/p-q.r"}}, "required": ["p"]})
    assert not _unbounded_runs(json_grammar(schema))
    compiled = grammars.compile("json", schema)
    assert _accepts(grammars, compiled, '{"p": {"n": 999999999999999, "x": -3.25}}')
    for bad in ('{"p": {"n": 4, "x": 1}}', '{"p": {"n": 1000000000000002, "x": 1}}',
                '{"p": {"n": 3, "x": 1111111111111111}}'):
        assert not _accepts(grammars, compiled, bad), bad
