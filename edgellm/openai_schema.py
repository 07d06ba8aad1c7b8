"""The OpenAI-compatible request bodies `edgellm serve` accepts, validated with pydantic, and the
OpenAI-style error body every failure answers with.

Field names follow OpenAI's API; the sampling extras OpenAI lacks use llama-server's names (top_k,
min_p, repeat_penalty, repeat_last_n, n_predict, ignore_eos), so clients written for either work.
Unknown fields are ignored (as llama-server does: clients send vendor extras such as cache_prompt);
a known field of the wrong type or out of range is a 400 that names it.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .generate import GenerationSettings
from .sampling import SamplingSettings

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed's range
WHOLE = 1 << 30  # repeat_last_n -1: a window longer than any context


class ApiError(Exception):
    """A request the server refuses: HTTP status + OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: "5" is not an integer, 1 is not true; finite numbers only (NaN would pass every range check)
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingFields(_Strict):
    """What both endpoints share: the answer's length, sampling and stops."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    n_predict: int | None = Field(None, ge=-1)  # llama-server's; -1 = until the context is full
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, lt=1)
    repeat_penalty: float | None = Field(None, gt=0)
    repeat_last_n: int | None = Field(None, ge=-1)  # llama-server's: 0 = off, -1 = the whole context
    seed: int | None = Field(None, ge=-1, le=SEED_MAX)  # -1 = random, as llama-server
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None
    user: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool = False
    suffix: str | None = None


def parse(model: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        # one error per union member tried: the one that got furthest into the value says the most
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        # pydantic adds the union member it tried ("str", "list[int]") to the location: not a field
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))]
        param = ".".join(loc) or None
        raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
    _refuse_unsupported(req)
    return req


def _refuse_unsupported(req: SamplingFields) -> None:
    """Say plainly what this server does not do, rather than silently answering something else."""
    def no(param: str, what: str) -> None:
        raise ApiError(400, f"{param}: {what} is not supported by edgellm serve", param=param)

    if req.n != 1:
        no("n", "more than one choice per request")
    if req.presence_penalty or req.frequency_penalty:
        no("presence_penalty" if req.presence_penalty else "frequency_penalty",
           "presence/frequency penalty (use repeat_penalty)")
    if req.logprobs:
        no("logprobs", "logprobs")
    if isinstance(req, ChatRequest):
        if req.tools:
            no("tools", "tool calling")
        if req.response_format and req.response_format.get("type", "text") != "text":
            no("response_format", "structured output")
    if isinstance(req, CompletionRequest):
        if req.echo:
            no("echo", "echo")
        if req.suffix:
            no("suffix", "suffix (fill-in-the-middle)")
        if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) and len(req.prompt) != 1:
            no("prompt", "a batch of prompts")


def generation_settings(req: SamplingFields, defaults: Any, room: int) -> GenerationSettings:
    """The engine's settings for a request: its own values, else the server's command-line ones
    (`defaults`: the chat app's ChatSettings, max_tokens None = until EOS or the context's end);
    at most `room` tokens."""
    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    limit = req.max_tokens or req.max_completion_tokens
    if limit is None and req.n_predict is not None:
        limit = None if req.n_predict == -1 else req.n_predict
    elif limit is None:
        limit = defaults.max_tokens
    if limit is not None and limit < 1:
        raise ApiError(400, "n_predict: must be at least 1 (or -1)", param="n_predict")
    max_tokens = room if limit is None else min(limit, room)
    seed = pick(req.seed, defaults.seed)
    penalty = pick(req.repeat_penalty, defaults.repeat_penalty)
    last_n = req.repeat_last_n
    if last_n == 0:
        penalty = 1.0  # llama-server: 0 turns the penalty off
    try:
        sampling = SamplingSettings(
            temperature=pick(req.temperature, defaults.temperature), top_k=pick(req.top_k, defaults.top_k),
            top_p=pick(req.top_p, defaults.top_p), min_p=pick(req.min_p, defaults.min_p), repeat_penalty=penalty,
            repeat_last_n=SamplingSettings.repeat_last_n if last_n in (None, 0) else (WHOLE if last_n == -1 else last_n),
            seed=None if seed == -1 else seed)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or defaults.stop)
    return GenerationSettings(max_tokens=max_tokens, sampling=sampling, stop_strings=[s for s in stop if s],
                              ignore_eos=req.ignore_eos)
