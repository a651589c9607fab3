"""The OpenAI-compatible API's bodies (pydantic): requests, as validated once at the boundary, and
responses and errors, as documented in ``/openapi.json``.

Requests are strict, as OpenAI's are (no ``true`` for 1 token, no ``2.5`` tokens, no ``"yes"`` for a
bool), and bounded before any work: more than :data:`MAX_MESSAGES` messages or :data:`MAX_STOP`
stop sequences are refused before their items are validated, stop sequences hold at most
:data:`MAX_STOP_CHARS` characters in all, token-id prompts are integers (not booleans, floats or
numeric strings). The engine checks what depends on the model: token ids below the vocabulary size,
the prompt's characters (per request, so per message too) against what the context can hold, and
its tokens.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, StrictBool, Tag, WithJsonSchema,
                      model_validator)
from pydantic_core import PydanticCustomError

from deltafleet.serve.request import VARIANT_NAME, InvalidRequestError, SamplingParams, check_unicode
from deltafleet.serve.sampling import SAMPLING_EPS

MAX_STOP = 4  # stop sequences per request (OpenAI's limit)
MAX_STOP_CHARS = 4096  # characters of a request's stop sequences, all together
MAX_STOP_TOKEN_IDS = 64  # stop_token_ids per request
MAX_MESSAGES = 2048  # messages per chat request
MAX_TOOLS = 128  # tools per chat request, and tool calls per message
MAX_PROMPTS = 256  # prompts per completions request (a list of texts or of token-id lists)
MAX_N = 128  # choices per prompt (OpenAI's limit)
MAX_LOGPROBS = 20  # likeliest tokens' log-probabilities per token (OpenAI's limit)
MAX_TEMPLATE_KWARGS_CHARS = 4096  # JSON characters of chat_template_kwargs
MAX_CONSTRAINT_CHARS = 65536  # characters of a request's grammar, regular expression, schema or choices (as JSON)
TOP_K_ALL = 2**31  # a top_k this large is past any vocabulary: no limit (the sampler's k is an int64)

# ------------------------------------------------------------------------------------ requests


class StreamOptions(BaseModel):
    # null is the default, as vLLM's Optional[bool]s take it
    include_usage: StrictBool | None = Field(None, description="usage on a last chunk (null: false, but true "
                                                                "with continuous_usage_stats, as in vLLM)")
    continuous_usage_stats: StrictBool | None = Field(None, description="vLLM's: each chunk's usage, its choice's "
                                                                          "so far (with include_usage)")

    def usage(self) -> tuple[bool, bool]:
        """``(include_usage, continuous_usage_stats)`` as vLLM takes them: continuous usage asks for the
        usage chunk too, unless ``include_usage`` is false."""
        continuous = bool(self.continuous_usage_stats)
        include = continuous if self.include_usage is None else self.include_usage
        return include, include and continuous


# OpenAI parameters this server does not implement, with the test of a value that asks for nothing
# (a client may send the default): any other value is a 400, never silently ignored. Parameters not
# named here or in the schemas (``user``, ``metadata``, ...) change nothing and are ignored.
def _number(value) -> Callable[[Any], bool]:
    """The no-op test of a numeric parameter: equal to ``value`` and a number (``true`` is not 1)."""
    return lambda v: v == value and isinstance(v, (int, float)) and not isinstance(v, bool)


UNSUPPORTED = {
    "best_of": lambda v: v is None,  # checked against n in check(): only best_of = n (no ranking)
    "suffix": lambda v: v == "",
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "tool_choice": lambda v: v in ("none", "auto"),  # with no tools: no call
    "function_call": lambda v: v in ("none", "auto"),
    "logit_bias": lambda v: v == {},
    # vLLM's extras not implemented here (and any guided_*): refused unless they ask for nothing
    "length_penalty": _number(1),
    "spaces_between_special_tokens": lambda v: v is True,
    "include_stop_str_in_output": lambda v: v is False,
    "use_beam_search": lambda v: v is False,
    "add_generation_prompt": lambda v: v is True,  # completions' (chat and /tokenize implement them)
    "continue_final_message": lambda v: v is False,
    "chat_template": lambda v: False,
    "allowed_token_ids": lambda v: False,
    "bad_words": lambda v: v == [],
    "logits_processors": lambda v: v == [],
    "truncate_prompt_tokens": lambda v: False,
    "prompt_logprobs": lambda v: False,
    "structural_tag": lambda v: False,
    "echo": lambda v: v is False,  # chat's (vLLM: the last message before the reply); completions implement theirs
    "return_tokens_as_token_ids": lambda v: v is False,
    "return_token_ids": lambda v: v is False,
    "priority": _number(0),  # vLLM's priority scheduling
    # OpenAI's: other output modalities, predicted outputs, a reasoning model's effort
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: False,
    "prediction": lambda v: False,
    "reasoning_effort": lambda v: False,
    "web_search_options": lambda v: False,
    "verbosity": lambda v: False,
    "service_tier": lambda v: v in ("auto", "default"),
    "store": lambda v: v is False,
    # chat's fields sent to completions, which take max_tokens and logprobs: k
    "max_completion_tokens": lambda v: False,
    "top_logprobs": lambda v: False,
    # vLLM's: prompt embeddings, a template's documents, disaggregated prefill, custom sampling args
    "prompt_embeds": lambda v: False,
    "documents": lambda v: v == [],
    "kv_transfer_params": lambda v: False,
    "vllm_xargs": lambda v: v == {},
}


def _unsupported(name: str, value) -> bool:
    """Whether extra parameter ``name`` asks for something this server does not do."""
    if value is None:
        return False
    if name.startswith("guided_"):  # vLLM's guided decoding, every one of its parameters
        return True
    return name in UNSUPPORTED and not UNSUPPORTED[name](value)


def _too_many(param: str, limit: int):
    """A before-validator: more than ``limit`` items is refused before any item is validated."""
    def check(value):
        if isinstance(value, list) and len(value) > limit:
            raise PydanticCustomError("array_above_max_length", f"Invalid '{param}': array too long. Expected an array "
                                      f"with maximum length {limit}, but got an array with length {len(value)} "
                                      "instead.")
        return value
    return BeforeValidator(check)


def _check_stop_chars(value):
    stops = [value] if isinstance(value, str) else value if isinstance(value, list) else []
    n = sum(len(s) for s in stops if isinstance(s, str))
    if n > MAX_STOP_CHARS:
        raise PydanticCustomError("string_above_max_length", f"Invalid 'stop': {n} characters in all; at most "
                                  f"{MAX_STOP_CHARS} characters of stop sequences are allowed per request.")
    return value


def _check_template_kwargs(value):
    """At most :data:`MAX_TEMPLATE_KWARGS_CHARS` characters of JSON: a template's switches, not text
    (which would skip the prompt's length checks)."""
    if isinstance(value, dict) and len(json.dumps(value, separators=(",", ":"), ensure_ascii=False)) > \
            MAX_TEMPLATE_KWARGS_CHARS:
        raise PydanticCustomError("string_above_max_length", "Invalid 'chat_template_kwargs': more than "
                                  f"{MAX_TEMPLATE_KWARGS_CHARS} characters of JSON.")
    return value


def _prompt_kind(value) -> str:
    if isinstance(value, list):
        if value and isinstance(value[0], str):
            return "texts"
        return "id_lists" if value and isinstance(value[0], list) else "ids"
    return "text"


_UNION_TAGS = ("one", "list", "text", "texts", "ids", "id_lists", "parts")  # Tags: not shown in a param
# The codes of the PydanticCustomErrors above: reported as they are, not as "invalid_value".
_OWN_ERRORS = ("array_above_max_length", "string_above_max_length", "unsupported_value")
_TEXT = {"type": "string", "minLength": 1}  # "" is refused by the engine: an empty prompt (0 tokens)
TokenId = Annotated[int, Field(ge=0, strict=True)]  # and below the vocabulary size: Engine.encode_prompt


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON Schema the output follows")
    strict: bool | None = Field(None, strict=True)


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of a JSON Schema, a regular expression, a choice of strings,
    an EBNF grammar, or any JSON object."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


def _json_text(value, param: str) -> str:
    """A JSON Schema (an object, or its JSON text) as canonical JSON text."""
    try:
        if isinstance(value, str):
            value = json.loads(value)
        if not isinstance(value, dict):
            raise InvalidRequestError(f"`{param}` must be a JSON Schema object", param, "invalid_value")
        return json.dumps(value, separators=(",", ":"))  # the properties' order is the output's
    except (json.JSONDecodeError, RecursionError) as e:
        why = "is nested too deeply" if isinstance(e, RecursionError) else f"is not valid JSON: {e}"
        raise InvalidRequestError(f"`{param}` {why}", param, "invalid_value") from None


# JSON Schema of what check() refuses: stream_options only with stream: true.
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


# Sampling fields where null means the default, as OpenAI and vLLM take it (clients send nulls).
NULL_IS_DEFAULT = ("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "min_p", "ignore_eos", "min_tokens", "skip_special_tokens", "echo")


_SCHEMA_METADATA = ("title", "description", "default", "examples")


def _sampling_schema(schema: dict) -> None:
    """The sampling requests' JSON Schema says what the server takes: null for each field of
    :data:`NULL_IS_DEFAULT` (its default), and stream_options only with stream: true."""
    schema.update(_STREAM_OPTIONS_NEED_STREAM)
    props = schema.get("properties", {})
    for name in NULL_IS_DEFAULT:
        prop = props.get(name)
        if prop is None:
            continue
        if "anyOf" in prop:
            if {"type": "null"} not in prop["anyOf"]:
                prop["anyOf"].append({"type": "null"})
            continue
        meta = {k: prop.pop(k) for k in _SCHEMA_METADATA if k in prop}
        props[name] = {"anyOf": [prop, {"type": "null"}], **meta}


def check_texts(request: BaseModel) -> None:
    """Refuse a lone surrogate in any text of ``request`` (``check_unicode``: a stop string, a
    template argument and a schema's key as much as the prompt), walking nested models, lists and
    maps, keys too, and naming the top-level field. The model id is left to its lookup: no model has
    such an id, so it is a 404 as any unknown one."""
    def walk(value, param: str) -> None:
        if isinstance(value, str):
            check_unicode(value, param)
        elif isinstance(value, BaseModel):
            for _, v in value:  # fields, then extras
                walk(v, param)
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(k, param)
                walk(v, param)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v, param)

    for name, value in request:
        if name != "model":
            walk(value, name)


MAX_REQUEST_ID = 256  # characters of a client's request id (body or X-Request-Id header)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=_sampling_schema)  # extra: for check

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in NULL_IS_DEFAULT}
        return data

    # strict, as OpenAI: no true for 1 token, no 2.5 tokens, no "yes" for a bool (an int is still a float)
    model: str
    max_tokens: int | None = Field(None, ge=1, strict=True)
    temperature: float = Field(1.0, ge=0.0, le=2.0, strict=True, allow_inf_nan=False,
                               description=f"below {SAMPLING_EPS:g} (0 included): greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, strict=True, description="the k most likely tokens only (vLLM's); "
                                                                    "0, -1, null or k past the vocabulary: all")
    stop: Annotated[Annotated[Annotated[str, WithJsonSchema(_TEXT), Tag("one")]
                              | Annotated[list[Annotated[str, WithJsonSchema(_TEXT)]], Field(max_length=MAX_STOP),
                                                                     _too_many("stop", MAX_STOP), Tag("list")],
                              Discriminator(lambda v: "one" if isinstance(v, str) else "list")] | None,
                    BeforeValidator(_check_stop_chars),
                    Field(description=f"up to {MAX_STOP} sequences, {MAX_STOP_CHARS} characters in all; the text "
                                      "ends before the first one generated")] = None
    seed: int | None = Field(None, strict=True, description="any integer")
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID, strict=True,
                                   description="vLLM's: the answer's id is `cmpl-<request_id>` (`chatcmpl-` for a "
                                               "chat); an `X-Request-Id` header takes precedence")
    ignore_eos: bool = Field(False, strict=True, description="vLLM's: eos does not end the completion")
    min_tokens: int = Field(0, ge=0, strict=True, description="vLLM's: eos and stop_token_ids cannot be "
                                                                "sampled before this many tokens")
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS),
                              _too_many("stop_token_ids", MAX_STOP_TOKEN_IDS)] | None = Field(
        None, description=f"vLLM's: up to {MAX_STOP_TOKEN_IDS} token ids (each below the vocabulary size) that end "
                          "the completion (finish reason stop, left out of the text)")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, strict=True, allow_inf_nan=False,
                                    description="subtracted once from the logit of any token of the output")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, strict=True, allow_inf_nan=False,
                                     description="subtracted from a token's logit once per time it is in the output")
    # from 0.01: dividing a logit by a smaller penalty can overflow float32 (1e-45 did), failing the request
    repetition_penalty: float = Field(1.0, ge=0.01, le=10.0, strict=True, allow_inf_nan=False,
                                      description="vLLM's: a prompt or output token's positive logit divided by it, "
                                                  "a negative one multiplied; 1: none")
    min_p: float = Field(0.0, ge=0.0, le=1.0, strict=True, allow_inf_nan=False,
                         description="vLLM's: tokens below min_p × the likeliest token's probability are not drawn")
    skip_special_tokens: bool = Field(True, strict=True, description="vLLM's: false keeps the special tokens the "
                                                                     "model generates in the text")
    n: int = Field(1, ge=1, le=MAX_N, strict=True, description="choices per prompt; with a seed, choice j "
                                                                  "samples with seed + j")
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: the output "
                                                                       "follows it (structured output)")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: the output follows this JSON Schema")
    guided_regex: str | None = Field(None, description="vLLM's: the output matches this regular expression")
    guided_choice: list[str] | None = Field(None, min_length=1, description="vLLM's: the output is one of these")
    guided_grammar: str | None = Field(None, description="vLLM's: the output follows this EBNF grammar")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's newer form of the guided_* "
                                                                             "fields")

    def logprob_count(self) -> int | None:
        """How many likeliest tokens' log-probabilities each token reports (None: no log-probabilities)."""
        return None

    def constraint(self) -> tuple[str, str | None, str] | None:
        """The output's grammar as ``(kind, spec, the field it came from)`` (serve/grammar.py), or None.

        Raises:
            InvalidRequestError: two fields ask for one, or one is malformed.
        """
        asked = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            if rf.type == "json_object":
                asked.append(("json_object", None, "response_format"))
            elif rf.json_schema is None:
                raise InvalidRequestError("`response_format` of type json_schema needs `json_schema`",
                                          "response_format", "invalid_value")
            else:
                asked.append(("json", _json_text(rf.json_schema.schema_, "response_format"), "response_format"))
        so = self.structured_outputs
        fields = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}
        if so is not None:
            fields.update({"structured_outputs.json": so.json_, "structured_outputs.regex": so.regex,
                           "structured_outputs.choice": so.choice, "structured_outputs.grammar": so.grammar})
            if so.json_object:
                asked.append(("json_object", None, "structured_outputs"))
        for name, value in fields.items():
            if value is None:
                continue
            kind = name.rsplit(".", 1)[-1].removeprefix("guided_")
            if kind == "json":
                asked.append(("json", _json_text(value, name), name))
            elif kind == "choice":
                asked.append(("choice", json.dumps(value), name))
            else:
                asked.append((kind, value, name))
        if len(asked) > 1:
            raise InvalidRequestError(f"only one structured-output constraint per request, got {len(asked)}: "
                                      f"{', '.join(a[2] for a in asked)}", asked[1][2], "invalid_value")
        if asked and len(asked[0][1] or "") > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(f"`{asked[0][2]}` is longer than {MAX_CONSTRAINT_CHARS} characters",
                                      asked[0][2], "invalid_value")
        return asked[0] if asked else None

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        constraint = self.constraint()
        top_k = self.top_k if self.top_k and 0 < self.top_k < TOP_K_ALL else 0  # any k past the vocabulary: all
        return SamplingParams(max_tokens, self.temperature, self.top_p, stop, self.seed, top_k,
                              self.ignore_eos, self.min_tokens, tuple(self.stop_token_ids or ()),
                              self.repetition_penalty, self.frequency_penalty, self.presence_penalty, self.min_p,
                              self.skip_special_tokens, self.logprob_count(),
                              constraint=None if constraint is None else constraint[:2],
                              constraint_param=constraint[2] if constraint else "response_format")

    def check(self) -> None:
        """Raise InvalidRequestError (400) on text that is not valid Unicode anywhere in the request
        (:func:`check_texts`), an empty stop string (as vLLM), ``stream_options`` without ``stream``,
        or a parameter of :data:`UNSUPPORTED` that asks for something."""
        check_texts(self)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if "" in stops:  # it would end every text before its first character: vLLM's 400
            raise InvalidRequestError("stop cannot contain an empty string.", "stop", "invalid_value")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                                      "stream_options", "invalid_value")
        best_of = (self.model_extra or {}).get("best_of")
        if best_of is not None and (type(best_of) is not int or best_of != self.n):
            raise InvalidRequestError(f"The parameter `best_of` (here {json.dumps(best_of)[:100]}) is not supported "
                                      f"by this server unless it equals n ({self.n}): choices are not ranked.",
                                      "best_of", "unsupported_parameter")
        for name, value in (self.model_extra or {}).items():
            if name != "best_of" and _unsupported(name, value):
                raise InvalidRequestError(f"The parameter `{name}` (here {json.dumps(value)[:100]}) is not supported "
                                          "by this server.", name, "unsupported_parameter")
        self.constraint()


class CompletionRequest(_Sampling):
    prompt: Annotated[
        Annotated[str, WithJsonSchema(_TEXT), Tag("text")]
        | Annotated[list[Annotated[str, WithJsonSchema(_TEXT)]], Field(min_length=1, max_length=MAX_PROMPTS),
                    _too_many("prompt", MAX_PROMPTS), Tag("texts")]
        | Annotated[list[TokenId], Field(min_length=1), Tag("ids")]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS),
                    _too_many("prompt", MAX_PROMPTS), Tag("id_lists")],
        Discriminator(_prompt_kind),
        Field(description=f"text, token ids (each below the vocabulary size), or a list of up to {MAX_PROMPTS} of "
                          "either: one choice per prompt and n, choice i·n + j for prompt i")]
    max_tokens: int | None = Field(16, ge=0, strict=True, description="OpenAI's default 16; 0 only with echo")
    echo: bool = Field(False, strict=True, description="the prompt before the completion, with its tokens' "
                                                         "log-probabilities when logprobs is set (not streamed)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True,
                                 description="each generated token's log-probability and those of the "
                                             f"`logprobs` likeliest (up to {MAX_LOGPROBS})")

    def logprob_count(self) -> int | None:
        return self.logprobs

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("`max_tokens: 0` needs `echo: true` (the prompt's log-probabilities only)",
                                      "max_tokens", "invalid_value")
        if self.echo and self.stream and self.max_tokens == 0:
            raise InvalidRequestError("`echo` with `max_tokens: 0` (the prompt alone) is not streamed by this "
                                      "server; ask without `stream`.", "stream", "unsupported_parameter")

    def sampling(self, max_tokens: int | None) -> SamplingParams:
        """As every request's, at least one token (``max_tokens: 0`` generates one that the answer
        drops), with the prompt's log-probabilities when ``echo`` and ``logprobs`` are set."""
        params = super().sampling(None if max_tokens is None else max(max_tokens, 1))
        if self.echo and self.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a text or token ids."""
        p = self.prompt
        return p if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]


TEXT_PARTS = {"type": "array", "items": {"anyOf": [  # a refusal part: an assistant's only
    {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": {"type": "string"}}},
    {"type": "object", "required": ["type", "refusal"], "properties": {"type": {"const": "refusal"},
                                                                       "refusal": {"type": "string"}}}]}}


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(BaseModel):
    """A tool call: in an assistant message of the history, and in an answer."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"] = Field(
        description="developer: as system (OpenAI's newer name for it); tool: a tool's result")
    content: Annotated[Annotated[str, Tag("text")] | Annotated[list[dict[str, Any]], WithJsonSchema(TEXT_PARTS),
                                                               Tag("parts")],
                       Discriminator(lambda v: "parts" if isinstance(v, list) else "text")] | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS, description="assistant: its tool calls")
    tool_call_id: str | None = Field(None, description="tool: the call it answers")

    def as_dict(self) -> dict[str, Any]:
        """``{"role", "content"}`` as the chat template reads it (``developer`` is ``system``), with an
        assistant's ``tool_calls`` (arguments as an object, as Hugging Face templates take them) and a
        tool result's ``tool_call_id``."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        # text or refusal parts (check_messages checked them), one a line, as vLLM renders them for
        # a template that takes string content
        return "\n".join(p[p["type"]] for p in self.content)


def _tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template takes them (None without tools)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


def check_messages(messages: list[ChatMessage]) -> None:
    """OpenAI's rules for a history: every message but an assistant's has ``content``; only assistant
    messages make calls, and a ``tool`` message answers one of the calls of the
    assistant message before it (other results between).

    Raises: InvalidRequestError naming the message."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.content is None and m.role != "assistant":  # (an assistant's may be null: a reply echoed back)
            raise InvalidRequestError(f"messages[{i}]: a message of role {m.role!r} needs `content`",
                                      f"messages.{i}.content", "missing_required_parameter")
        if isinstance(m.content, list):
            _check_parts(m.content, i, m.role)
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError(f"messages[{i}]: only assistant messages have `tool_calls`",
                                      f"messages.{i}.tool_calls", "invalid_value")
        if m.role == "tool":
            if m.tool_call_id is None:
                raise InvalidRequestError(f"messages[{i}]: a tool message needs `tool_call_id`",
                                          f"messages.{i}.tool_call_id", "invalid_value")
            if m.tool_call_id not in open_calls:
                raise InvalidRequestError(f"messages[{i}]: a tool message must answer a call of the assistant "
                                          "message before it", f"messages.{i}.tool_call_id", "invalid_value")
        else:
            open_calls = {c.id for c in m.tool_calls or ()}


def _check_parts(parts: list[dict[str, Any]], i: int, role: str) -> None:
    """A message's content parts, as OpenAI takes them: at least one (an assistant's may be none), each
    ``{"type": "text", "text": str}``, or an assistant's ``{"type": "refusal", "refusal": str}``;
    other types (images, audio, files) are not served. Raises InvalidRequestError naming the part."""
    if not parts and role != "assistant":
        raise InvalidRequestError(f"messages[{i}]: `content` must hold at least one part",
                                  f"messages.{i}.content", "invalid_value")
    for j, p in enumerate(parts):
        kind, where = p.get("type"), f"messages[{i}].content[{j}]"
        if kind not in ("text", "refusal"):
            raise InvalidRequestError(f"{where}: only text content parts are supported, got type {kind!r}",
                                      f"messages.{i}.content.{j}.type", "invalid_value")
        if kind == "refusal" and role != "assistant":
            raise InvalidRequestError(f"{where}: a refusal part is an assistant's", f"messages.{i}.content.{j}.type",
                                      "invalid_value")
        if not isinstance(p.get(kind), str):  # the part's text is under its type's name
            raise InvalidRequestError(f"{where}: a {kind} part needs `{kind}`, a string",
                                      f"messages.{i}.content.{j}.{kind}", "invalid_value")


def _arguments(text: str) -> dict[str, Any]:
    """A tool call's arguments (JSON text of an object) as an object, none (``""``) as ``{}`` as vLLM
    reads them; InvalidRequestError otherwise."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequestError("a tool call's `arguments` must be the JSON text of an object", "messages",
                                  "invalid_value")
    return value


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments (an object)")
    strict: bool | None = Field(None, strict=True,
                                description="accepted; required and named calls always follow the schema")


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ADD_GENERATION_PROMPT = ("vLLM's: the rendered chat ends with the opening of the assistant's turn (the "
                         "template's generation prompt); false: it ends as the messages do")
CONTINUE_FINAL_MESSAGE = ("vLLM's: the rendered chat ends inside the last message, which the answer continues "
                          "(an assistant's prefill); needs add_generation_prompt false")


def check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule for a chat's ending: InvalidRequestError where both are asked for."""
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to true: "
                                  "the reply either opens a new turn or continues the last message.",
                                  "continue_final_message", "invalid_value")


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES),
                        _too_many("messages", MAX_MESSAGES)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS), _too_many("tools", MAX_TOOLS)] | None = Field(
        None, description="functions the model may call, rendered by its chat template (Hermes format: "
                          "<tool_call>{...}</tool_call>)")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto (the default with tools): the model decides; required or a named function: the "
                          "output is one call, held to the tool's schema; none: no call is parsed")
    parallel_tool_calls: bool | None = Field(None, strict=True, description="accepted; with required or a named "
                                                                            "function, one call")
    chat_template_kwargs: Annotated[dict[str, Any] | None, BeforeValidator(_check_template_kwargs)] = Field(
        None, description="vLLM's: more variables for the model's chat template (e.g. a template's own switches), "
                          f"{MAX_TEMPLATE_KWARGS_CHARS} characters of JSON at most")
    logprobs: bool | None = Field(False, strict=True, description="each generated token's log-probability")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True,
                                     description="with logprobs: those of this many likeliest tokens too")
    add_generation_prompt: bool = Field(True, strict=True, description=ADD_GENERATION_PROMPT)
    continue_final_message: bool = Field(False, strict=True, description=CONTINUE_FINAL_MESSAGE)

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check(self) -> None:
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("`top_logprobs` needs `logprobs: true`", "top_logprobs", "invalid_value")
        check_continuation(self.add_generation_prompt, self.continue_final_message)
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise InvalidRequestError("two tools have one name", "tools", "invalid_value")
        for i, t in enumerate(self.tools or ()):
            params = t.function.parameters
            if params is not None and params.get("type", "object") != "object":
                raise InvalidRequestError(f"tool {t.function.name!r}: `parameters` must be a JSON Schema of an "
                                          "object", f"tools.{i}.function.parameters", "invalid_value")
        check_messages(self.messages)
        choice = self.tool_choice
        if not names and choice not in (None, "none", "auto"):
            raise InvalidRequestError("`tool_choice` is only allowed when `tools` are specified", "tool_choice",
                                      "invalid_value")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequestError(f"`tool_choice` names {choice.function.name!r}, which is not one of the "
                                      "tools", "tool_choice", "invalid_value")

    def calls_tools(self) -> bool:
        """Whether the answer's tool-call blocks are parsed into ``tool_calls``: tools given and
        ``tool_choice`` not ``none``."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return _tool_dicts(self.tools)

    def constraint(self) -> tuple[str, str | None, str] | None:
        """As for every request, and ``tool_choice: "required"`` or a named function: one call, held
        to the tool's schema (serve/grammar.py's ``tool_call``)."""
        asked = super().constraint()
        choice = self.tool_choice
        if not self.tools or not (choice == "required" or isinstance(choice, NamedToolChoice)):
            return asked
        if asked is not None:
            raise InvalidRequestError(f"only one structured-output constraint per request, got 2: tool_choice, "
                                      f"{asked[2]}", asked[2], "invalid_value")
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        spec = json.dumps({"tools": self.tool_dicts(), "name": name})
        if len(spec) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequestError(f"`tools` is longer than {MAX_CONSTRAINT_CHARS} characters as JSON", "tools",
                                      "invalid_value")
        return "tool_call", spec, "tools"
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a completion ``prompt`` or chat ``messages``, as generation would
    encode them."""

    model: str | None = Field(None, description="a served model id; null: the base")
    prompt: Annotated[str, WithJsonSchema(_TEXT)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES),
                        _too_many("messages", MAX_MESSAGES)] | None = None
    add_special_tokens: bool = Field(True, strict=True, description="prompt: the tokenizer's own (e.g. BOS)")
    add_generation_prompt: bool = Field(True, strict=True, description="messages: " + ADD_GENERATION_PROMPT)
    continue_final_message: bool = Field(False, strict=True, description="messages: " + CONTINUE_FINAL_MESSAGE)
    chat_template_kwargs: Annotated[dict[str, Any] | None, BeforeValidator(_check_template_kwargs)] = Field(
        None, description="messages: as in chat completions")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS), _too_many("tools", MAX_TOOLS)] | None = Field(
        None, description="messages: rendered as in chat completions")
    return_token_strs: bool = Field(False, strict=True)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return _tool_dicts(self.tools)

    def check(self) -> None:
        """Raise InvalidRequestError unless exactly one of ``prompt`` and ``messages`` is given, or on
        text that is not valid Unicode (:func:`check_texts`)."""
        check_texts(self)
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of `prompt` and `messages`", "prompt", "invalid_value")
        if self.tools and self.messages is None:
            raise InvalidRequestError("`tools` go with `messages`", "tools", "invalid_value")
        if self.messages is not None:
            check_messages(self.messages)
        if self.messages is not None:
            check_continuation(self.add_generation_prompt, self.continue_final_message)


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text (special tokens kept)."""

    model: str | None = Field(None, description="a served model id; null: the base")
    tokens: list[TokenId]


class Detokenized(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str


class LoadVariantRequest(BaseModel):
    """``POST /v1/load_variant`` (vLLM's ``/v1/load_lora_adapter`` for deltas)."""

    model_config = ConfigDict(extra="forbid")
    variant: str = Field(pattern=VARIANT_NAME, description="name (or model id): served as <family>-<variant>")
    path: str | None = Field(None, description="artifact folder, relative to (or inside) the artifact root; "
                                               "default: <artifact root>/<variant>")


class UnloadVariantRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    variant: str = Field(description="name or model id")


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body, for :class:`LoadVariantRequest`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(pattern=VARIANT_NAME, description="the model id to serve (<family>-<variant>) or the "
                                                             "variant's name")
    lora_path: str | None = Field(None, description="artifact folder, as LoadVariantRequest.path")
    load_inplace: bool = Field(False, strict=True, description="vLLM's: replace the adapter served under that name (without "
                                                  "it, a name already served is refused with 400)")
    base_model_name: str | None = Field(None, description="what the Gateway API Inference Extension's adapter sync "
                                                          "sends beside the adapter; ignored, as vLLM ignores it")


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = Field(None, description="vLLM's numeric id: not used")


# ------------------------------------------------------------------------------------ responses


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error, server_error or "
                                  "service_unavailable_error")
    param: str | None = Field(description="the request parameter at fault, if any")
    code: str | None = Field(description="e.g. model_not_found, context_length_exceeded, invalid_json")


class ErrorResponse(BaseModel):
    """OpenAI's error object: every status but 200."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "tool_calls"]
STOP_REASON = ("vLLM's: the stop string (of `stop`) or token id (of `stop_token_ids`) that ended the choice; "
               "null when it ended otherwise (the model's end-of-sequence token, a grammar's end, length, "
               "tool calls). Streamed: on the chunk with the finish_reason, null on the others")


class CompletionLogprobs(BaseModel):
    """OpenAI's completions shape: per token (with ``echo``, the prompt's first), its text,
    log-probability, the likeliest tokens' (text → log-probability) and where its text starts; the
    prompt's first token has null for both (nothing comes before it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = Field(None, description=STOP_REASON)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls only")
    tool_calls: list[ToolCall] | None = Field(None, description="with tools: the calls the answer made")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason
    stop_reason: int | str | None = Field(None, description=STOP_REASON)


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelInfo(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None = Field(description="the base's id for a variant, null for the base")
    root: str = Field(description="the base's id")
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelInfo]


class LoadedVariant(ModelInfo):
    loaded_from: Literal["device", "host", "disk"] = Field(description="the delta cache tier it came from")
    load_seconds: float


class UnloadedVariant(BaseModel):
    id: str
    object: Literal["model"]
    unloaded: Literal[True]


class DeltaCacheState(BaseModel):
    object: Literal["delta_cache"]
    device_bytes: int
    device_budget_bytes: int
    host_bytes: int
    host_budget_bytes: int | None
    variants: dict[str, dict[str, Any]] = Field(description="per model id: tier, bytes, requests in flight "
                                                            "(in_flight_old: on old versions), decayed request "
                                                            "count, pinned")


class Health(BaseModel):
    status: Literal["ok"]
