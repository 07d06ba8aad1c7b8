"""`edgellm serve`: an OpenAI-compatible HTTP server for the local model (one user, one model).

Routes: POST /v1/chat/completions, POST /v1/completions (streaming SSE or not), GET /v1/models,
GET /health (also without the /v1 prefix, as llama-server). Starlette + uvicorn: a small, well-kept
ASGI stack whose StreamingResponse already watches for the client leaving, and nothing that insists
on its own error format. Generation runs on one worker thread (serve_worker.py), requests one at a
time in arrival order; the engine keeps the KV prefix between them, so a chat that re-sends its
history only prefills the new turn.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable

from .errors import EdgeLLMError
from .generate import Done, GenerationStats
from .openai_schema import ApiError, ChatRequest, CompletionRequest, generation_settings, parse
from .serve_worker import Job, QueueFull, Scheduler

log = logging.getLogger("uvicorn.error")  # uvicorn's own log: one format, one place
MAX_BODY = 32 * 2**20  # a prompt longer than any context is far smaller
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "stopped": "stop"}


# ------------------------------------------------------------------------------------------------
# Prompts
# ------------------------------------------------------------------------------------------------
class ChatPrompts:
    """Chat messages → prompt ids. An answer this server wrote is spliced back in as the exact ids the
    model produced (the chat app's rule, tui/session.py): text → ids does not always round-trip, and a
    different split would cost the client its KV prefix."""

    def __init__(self, engine: Any, tokenizer: Any, keep: int = 64):
        from .tui.session import ChatSession

        self.session = ChatSession(engine, tokenizer)
        self.answers: OrderedDict[str, list[int]] = OrderedDict()  # answer text → its ids, newest last
        self.keep = keep

    def ids(self, messages: list[Any], default_system: str | None) -> list[int]:
        from .tui.history import Conversation, Message

        conv = Conversation(system=default_system or "")
        msgs = list(messages)
        if msgs and msgs[0].role in ("system", "developer"):
            conv.system = msgs.pop(0).text()
        for m in msgs:
            role = "system" if m.role == "developer" else m.role
            text = m.text()
            tokens = self.answers.get(text) if role == "assistant" else None
            conv.messages.append(Message(role, text, tokens=list(tokens) if tokens else None))
        return self.session.encode(conv)

    def remember(self, done: Done) -> None:
        """Keep an answer's ids, unless a stop string cut it (then the ids run past the text)."""
        if done.stats.finish_reason in ("stop", "stopped") or not done.tokens:
            return
        self.answers[done.text] = list(done.tokens)
        self.answers.move_to_end(done.text)
        while len(self.answers) > self.keep:
            self.answers.popitem(last=False)


# ------------------------------------------------------------------------------------------------
# Response pieces
# ------------------------------------------------------------------------------------------------
def timings(stats: GenerationStats, job: Job) -> dict[str, Any]:
    """llama-server's `timings` object (prompt_n counts only the tokens computed; cache_n the reused
    ones), its draft counts, plus our TTFT and the time spent waiting in the queue."""
    ms = 1000.0
    t = {"cache_n": stats.reused_tokens,
         "prompt_n": stats.prefill_tokens, "prompt_ms": stats.prefill_s * ms,
         "prompt_per_token_ms": stats.prefill_s * ms / stats.prefill_tokens if stats.prefill_tokens else 0.0,
         "prompt_per_second": stats.prefill_tok_s,
         "predicted_n": stats.generated_tokens, "predicted_ms": stats.decode_s * ms,
         "predicted_per_token_ms": 1000.0 / stats.decode_tok_s if stats.decode_tok_s else 0.0,
         "predicted_per_second": stats.decode_tok_s,
         "ttft_ms": stats.ttft_s * ms, "queue_ms": job.queue_s * ms}
    if stats.draft:
        t.update(draft=stats.draft, draft_n=stats.draft_proposed, draft_n_accepted=stats.draft_accepted,
                 draft_acceptance_rate=stats.acceptance_rate)
    return t


def usage(stats: GenerationStats) -> dict[str, Any]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.reused_tokens}}


def error_response(e: ApiError):
    from starlette.responses import JSONResponse

    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------------------------
# The app
# ------------------------------------------------------------------------------------------------
class Server:
    """The routes, bound to one engine."""

    def __init__(self, engine: Any, model_id: str, defaults: Any, system: str | None = None,
                 api_key: str | None = None, max_waiting: int = 8):
        """`defaults`: the sampling settings of requests that set none (tui.session.ChatSettings);
        `system`: the system prompt of chats that send none."""
        self.engine = engine
        self.system = system
        self.tokenizer = engine.tokenizer
        self.model_id = model_id
        self.defaults = defaults
        self.api_key = api_key
        self.created = int(time.time())
        self.prompts = ChatPrompts(engine, self.tokenizer)
        self.scheduler = Scheduler(engine, max_waiting, on_done=log_answer)

    def app(self):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        routes = [Route("/health", self.health, methods=["GET"])]
        for prefix in ("/v1", ""):
            routes += [Route(f"{prefix}/chat/completions", self.guard(self.chat), methods=["POST"]),
                       Route(f"{prefix}/completions", self.guard(self.completions), methods=["POST"]),
                       Route(f"{prefix}/models", self.guard(self.models), methods=["GET"])]

        async def http_error(request, exc: HTTPException):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return error_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind))

        async def server_error(request, exc: Exception):
            return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))

        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            self.scheduler.close()

        return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error},
                         lifespan=lifespan)

    def guard(self, handler: Callable) -> Callable:
        """The API key check, then the handler; an ApiError anywhere becomes its OpenAI error body."""
        async def endpoint(request):
            try:
                if self.api_key is not None:
                    auth = request.headers.get("authorization", "")
                    given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
                    if not secrets.compare_digest(given.encode(), self.api_key.encode()):
                        raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                       code="invalid_api_key")
                return await handler(request)
            except ApiError as e:
                return error_response(e)
        return endpoint

    # -- routes ----------------------------------------------------------------------------------
    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", **self.scheduler.counts()})

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "edgellm",
             "meta": {"n_ctx": self.engine.max_seq_len, "n_vocab": self.tokenizer.vocab_size}}]})

    async def chat(self, request):
        req: ChatRequest = parse(ChatRequest, await read_json(request))
        try:
            ids = self.prompts.ids(req.messages, self.system)
        except EdgeLLMError as e:  # the chat template refused the messages
            raise ApiError(400, str(e), param="messages") from None
        return await self.answer(request, req, ids, chat=True)

    async def completions(self, request):
        req: CompletionRequest = parse(CompletionRequest, await read_json(request))
        prompt = req.prompt[0] if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str) \
            else req.prompt
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            vocab = self.tokenizer.vocab_size
            if any(not 0 <= i < vocab for i in ids):
                raise ApiError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
        if not ids:
            raise ApiError(400, "prompt: empty", param="prompt")
        return await self.answer(request, req, ids, chat=False)

    # -- one answer --------------------------------------------------------------------------------
    async def answer(self, request, req, ids: list[int], chat: bool):
        ctx = self.engine.max_seq_len
        if len(ids) >= ctx:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context holds {ctx} "
                                f"(start edgellm serve with a larger --ctx)", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        settings = generation_settings(req, self.defaults, room=ctx - len(ids))
        try:
            job = self.scheduler.submit(ids, settings)
        except QueueFull:
            raise ApiError(429, f"the server is busy: {self.scheduler.max_waiting} requests are already waiting "
                                f"(start edgellm serve with a larger --queue)", "rate_limit_error",
                           code="queue_full") from None
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": self.model_id}
        if req.stream:
            from starlette.responses import StreamingResponse

            return StreamingResponse(self.stream(job, head, chat, req), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self.whole(request, job, head, chat)

    async def whole(self, request, job: Job, head: dict, chat: bool):
        """Wait for the whole answer, stopping it if the client hangs up meanwhile."""
        from starlette.responses import JSONResponse

        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        try:
            done = await self._collect(job)
        finally:
            watcher.cancel()
            self.scheduler.cancel(job)  # a no-op once the job has finished
        if done is None or done.stats.finish_reason == "stopped":
            return JSONResponse({}, status_code=499)  # nobody is listening
        reason = FINISH[done.stats.finish_reason]
        if chat:
            self.prompts.remember(done)
            choice = {"index": 0, "message": {"role": "assistant", "content": done.text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": done.text, "logprobs": None, "finish_reason": reason}
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": usage(done.stats), "timings": timings(done.stats, job)})

    async def _collect(self, job: Job) -> Done | None:
        async for ev in self._events(job):
            if isinstance(ev, Done):
                return ev
        return None

    async def _watch_disconnect(self, request, job: Job) -> None:
        # the body is read, so the next ASGI message is the client hanging up
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.scheduler.cancel(job)

    async def _events(self, job: Job) -> AsyncIterator[Any]:
        try:
            async for ev in self.scheduler.events(job):
                yield ev
        except EdgeLLMError as e:
            raise ApiError(400, str(e)) from None

    async def stream(self, job: Job, head: dict, chat: bool, req) -> AsyncIterator[str]:
        """SSE chunks; Starlette cancels this generator when the client hangs up, which stops the job."""
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: Any = None, finish: str | None = None, **extra: Any) -> str:
            if chat:
                choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            return sse({**head, "object": obj, "choices": [choice], **extra})

        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""})
            async for ev in self._events(job):
                if isinstance(ev, Done):
                    if chat:
                        self.prompts.remember(ev)
                    yield chunk(finish=FINISH[ev.stats.finish_reason], timings=timings(ev.stats, job))
                    if req.stream_options is not None and req.stream_options.include_usage:
                        yield sse({**head, "object": obj, "choices": [], "usage": usage(ev.stats)})
                elif ev.text:
                    yield chunk({"content": ev.text} if chat else ev.text)
            yield "data: [DONE]\n\n"
        except ApiError as e:  # the headers are gone: report in the stream, as llama-server does
            yield sse(e.body())
        finally:
            self.scheduler.cancel(job)  # the client hung up (or a no-op: the job has finished)


def log_answer(job: Job, done: Done) -> None:
    """One line per finished generation (called on the worker thread)."""
    s = done.stats
    gone = " (client disconnected)" if s.finish_reason == "stopped" else ""
    log.info(f"answered: {s.prompt_tokens} prompt ({s.reused_tokens} cached) + {s.generated_tokens} tokens · "
             f"queue {job.queue_s:.3f} s · TTFT {s.ttft_s:.3f} s · {s.decode_tok_s:.1f} tok/s · "
             f"{s.finish_reason}{gone}")


async def read_json(request) -> Any:
    """The body as JSON: too large → 413, not JSON → 400."""
    body = bytearray()  # read in parts, so a huge body is refused before it is all in memory
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY // 2**20} MiB")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})") from None
