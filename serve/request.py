"""What a request is, at every layer of the server: its sampling parameters, the steps it yields,
the finished completion, and the errors that end it (each with the HTTP status the API gives it).

A leaf module: the scheduler, the engine and the HTTP app import it, and it imports none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from deltafleet.serve.delta import VariantDelta

FinishReason = Literal["stop", "length"]
VARIANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # served as <family>-<name>


class ModelNotFoundError(LookupError):
    """No base or variant is served under this model id (HTTP 404)."""


class VariantUnavailableError(RuntimeError):
    """The variant exists but cannot be served now (HTTP 503): its artifact is missing or corrupt, or
    (``transient``, with Retry-After) no device slot came free in time. ``reason``: why, without the
    variant's name."""

    def __init__(self, message: str, transient: bool = False, reason: str | None = None):
        super().__init__(message)
        self.transient = transient
        self.reason = reason if reason is not None else message


class VariantInUseError(RuntimeError):
    """The variant cannot be unloaded or replaced now: requests are running on it (HTTP 409)."""


class GenerationError(RuntimeError):
    """Generating one request failed on the server (HTTP 500), e.g. its logits were not finite. It ends
    that request only; the other sequences of its batch go on."""


class TensorParallelError(GenerationError):
    """The tensor-parallel group failed under a request being generated (HTTP 500, as any failed
    generation): a rank died, or did not answer within ``tp_timeout_s``. Unlike its base class it
    ends every request, and the server shuts down (serve/tp.py, ``TPContext.fail``). ``reason``: what
    happened, naming the rank where rank 0 can tell."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}: this server cannot generate any more and shuts down")
        self.reason = reason


class EngineFailedError(RuntimeError):
    """The engine cannot generate any more, for ``reason`` (its tensor-parallel group failed), and
    the server is shutting down (HTTP 503 ``engine_failed``, as ``/health`` answers): every request
    that was not being generated when it failed, and every later one, is refused."""

    def __init__(self, reason: str):
        super().__init__(f"The server cannot generate any more ({reason}) and is shutting down; send the "
                         "request to another server, or again once this one is restarted.")
        self.reason = reason


class ServerShuttingDownError(RuntimeError):
    """The server is shutting down (HTTP 503): a request not yet started is refused at once, and one
    still running when ``timeout_graceful_shutdown_s`` has passed is cut off."""


class InvalidRequestError(ValueError):
    """The request cannot be served as asked, e.g. the prompt is too long (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def check_unicode(text: str, param: str) -> None:
    """Raise InvalidRequestError ``invalid_unicode`` on text that is not valid Unicode: JSON lets a
    client send a lone surrogate (``"\\ud83d"``), which neither UTF-8 nor the tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"`{param}` is not valid Unicode (a lone surrogate at "
                                  f"character {e.start})", param, "invalid_unicode") from None


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below sampling.SAMPLING_EPS (0 included): greedy
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    top_k: int = 0  # 0: no limit
    ignore_eos: bool = False               # eos is a token like any other: generate to max_tokens
    min_tokens: int = 0                    # eos and stop_token_ids cannot be sampled before this many
    stop_token_ids: tuple[int, ...] = ()   # end the completion (finish "stop"), left out of the text
    repetition_penalty: float = 1.0        # vLLM's (> 0; 1: none): prompt and output tokens
    frequency_penalty: float = 0.0         # OpenAI's (−2…2): × each token's count in the output
    presence_penalty: float = 0.0          # OpenAI's (−2…2): once for any token of the output
    min_p: float = 0.0                     # vLLM's (0…1): tokens below min_p × the likeliest's probability dropped
    skip_special_tokens: bool = True       # vLLM's: special tokens the model generates are left out of the text
    logprobs: int | None = None            # each token's log-probability and its `logprobs` likeliest (0–20); None: none
    prompt_logprobs: int | None = None     # the same for each prompt token after the first (echo); None: none
    constraint: tuple[str, str | None] | None = None  # (kind, spec) of serve/grammar.py: the output's grammar
    constraint_param: str = "response_format"  # the request field it came from (named in its errors)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


@dataclass
class Step:
    """One sampled token: the text it releases ('' while held back) and, on the last, why it ended."""

    token_id: int
    text: str
    finish_reason: FinishReason | None = None
    logprob: float | None = None                       # the model's log-softmax of this token (logprobs asked)
    token_str: str | None = None                       # the token decoded alone (logprobs asked)
    top_logprobs: list[tuple[str, float]] | None = None  # the `logprobs` likeliest tokens: (decoded, log-probability)
    token_bytes: list[bytes] | None = None             # the token's and then the likeliest ones' own bytes (logprobs)
    prompt_logprobs: list[tuple[str, float, list[tuple[str, float]]]] | None = None  # first Step: prompt tokens 2…
    stop_reason: int | str | None = None  # last Step, finish "stop": the stop string or stop_token_ids id that ended it


@dataclass
class Request:
    """A checked request, ready to run: see :meth:`Engine.prepare`."""

    model_id: str
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    delta: VariantDelta | None
    released: bool = False  # its hold on the variant's delta ended (Engine.release)
    grammar: object = None  # params.constraint compiled (serve/grammar.py), None without one


@dataclass
class Completion:
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int] = field(default_factory=list)
