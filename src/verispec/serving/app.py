"""The OpenAI-compatible HTTP API: FastAPI routes in front of the batching scheduler.

``create_app`` builds a complete app (no uvicorn needed: tests and embedders can mount it or
drive it with any ASGI server). The event loop never runs a model: it tokenizes, validates,
submits to the :class:`~verispec.serving.scheduler.Scheduler` thread and relays that request's
events, as Server-Sent Events when ``stream`` is set.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from verispec.drafters.base import Drafter
from verispec.engine.decoder import SpeculativeDecoder, StepResult
from verispec.models import LoadedModel, encode_chat, encode_prompt
from verispec.sampling import SamplingParams
from verispec.serving.metrics import ServerMetrics
from verispec.serving.protocol import ChatCompletionBody, CompletionBody, OpenAIError, GenerationBody
from verispec.serving.responses import ResponseShape
from verispec.serving.scheduler import GenerationRequest, QueueFullError, RequestFailed, Scheduler, SchedulerClosedError, SchedulerConfig
from verispec.serving.text_stream import TextStream

_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


@dataclass(frozen=True)
class ServeConfig:
    model_id: str  # the name clients pass as "model"
    api_key: str | None = None  # None: no authentication (bind to loopback only)
    default_max_tokens: int = 256  # when a request gives none (cut to what the context window leaves)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("model_id must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (pass None for no authentication)")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens!r}")


def create_app(config: ServeConfig, target: LoadedModel, drafter: Drafter | None) -> FastAPI:
    """The server app for ``target`` (a LoadedModel with its tokenizer) speculating with ``drafter``."""
    if target.tokenizer is None:
        raise ValueError("the target has no tokenizer; the server takes text prompts")
    metrics = ServerMetrics()
    scheduler = Scheduler(target.model, drafter, target.tokenizer, config.scheduler, metrics)
    generation = _Generation(config, target, scheduler)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)

    app = FastAPI(title="verispec", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.add_middleware(_CountRequests, metrics=metrics)
    _install_error_handlers(app)
    authorized = [Depends(_authorization(config.api_key))]

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "running": scheduler.running, "waiting": scheduler.waiting}

    @app.get("/metrics", dependencies=authorized)
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": config.model_id, "object": "model", "created": generation.created, "owned_by": "verispec"}]}

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(body: CompletionBody, request: Request) -> Response:
        generation.check_model(body)
        if isinstance(body.prompt, str):
            prompt_ids = generation.encode(lambda: encode_prompt(target.tokenizer, body.prompt, chat=False), "prompt")
        else:
            prompt_ids = generation.check_token_ids(body.prompt)
        return await generation.respond(body, prompt_ids, ResponseShape(config.model_id, chat=False), request)

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
        generation.check_model(body)
        messages = [message.as_template_message() for message in body.messages]
        prompt_ids = generation.encode(lambda: encode_chat(target.tokenizer, messages, add_generation_prompt=True), "messages")
        return await generation.respond(body, prompt_ids, ResponseShape(config.model_id, chat=True), request)

    return app


class _Generation:
    """Validation, submission and relaying shared by the two generation endpoints."""

    def __init__(self, config: ServeConfig, target: LoadedModel, scheduler: Scheduler) -> None:
        self.config, self.target, self.scheduler = config, target, scheduler
        self.tokenizer = target.tokenizer
        self.eos = SpeculativeDecoder(target).default_stop()
        self.context_window = int(target.model.config.get_text_config(decoder=True).max_position_embeddings)
        self.vocab_size = int(target.model.get_output_embeddings().out_features)
        self.created = int(time.time())
        # The monitor's per-key scope: a short hash, never the key itself (it ends up in metrics and logs).
        self.client = "anonymous" if config.api_key is None else hashlib.sha256(config.api_key.encode()).hexdigest()[:8]

    def check_model(self, body: GenerationBody) -> None:
        if body.model != self.config.model_id:
            raise OpenAIError(404, f"The model '{body.model}' does not exist; this server serves '{self.config.model_id}'", param="model", code="model_not_found")

    def encode(self, encode, param: str) -> list[int]:  # noqa: ANN001 - a thunk returning token ids
        try:
            return encode()
        except ValueError as error:  # empty prompt, a template that refuses the messages
            raise OpenAIError(400, str(error), param=param) from None

    def check_token_ids(self, ids: list[int]) -> list[int]:
        if any(not 0 <= token < self.vocab_size for token in ids):
            raise OpenAIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return ids

    def _generation_request(self, body: GenerationBody, prompt_ids: list[int], sink) -> GenerationRequest:  # noqa: ANN001
        room = self.context_window - len(prompt_ids)
        if room < 1:
            raise OpenAIError(400, f"the prompt has {len(prompt_ids)} tokens; this model's context window is {self.context_window}", param="messages" if isinstance(body, ChatCompletionBody) else "prompt", code="context_length_exceeded")
        max_tokens = body.requested_max_tokens()
        if max_tokens is None:
            max_tokens = min(self.config.default_max_tokens, room)
        elif max_tokens > room:
            raise OpenAIError(400, f"max_tokens {max_tokens} plus the prompt's {len(prompt_ids)} tokens exceed this model's context window of {self.context_window}", param="max_tokens", code="context_length_exceeded")
        try:
            sampling = SamplingParams(temperature=float(body.temperature), top_k=body.top_k, top_p=float(body.top_p), seed=body.seed)
        except ValueError as error:
            raise OpenAIError(400, str(error)) from None
        return GenerationRequest(prompt_ids, max_tokens, sampling, self.eos + list(body.stop), sink, client=self.client)

    async def respond(self, body: GenerationBody, prompt_ids: list[int], shape: ResponseShape, http: Request) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StepResult | RequestFailed] = asyncio.Queue()
        request = self._generation_request(body, prompt_ids, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        try:
            self.scheduler.submit(request)
        except QueueFullError as error:
            raise OpenAIError(429, f"the server is busy: {error}; retry later", type="rate_limit_error", code="rate_limit_exceeded") from None
        except SchedulerClosedError as error:
            raise OpenAIError(503, str(error), type="server_error", code="service_unavailable") from None
        text = TextStream(self.tokenizer, list(body.stop))
        if body.stream:
            return StreamingResponse(self._stream(request, events, text, shape, body.include_usage), media_type="text/event-stream")
        checked = [time.monotonic()]
        try:
            while True:
                event = await self._next_event(events, http, checked)
                if event is None:  # the client hung up: stop generating for nobody
                    return Response(status_code=499)
                if isinstance(event, RequestFailed):
                    raise OpenAIError(500, event.message, type="server_error")
                text.push(event.token_ids, final=event.finish_reason is not None)
                if event.finish_reason is not None:
                    return JSONResponse(shape.response(text.text(), event.finish_reason, event.stats))
        finally:
            request.cancel()  # no-op once finished; frees the row if this handler was cancelled

    async def _next_event(self, events: asyncio.Queue, http: Request, checked: list[float]) -> StepResult | RequestFailed | None:
        """The request's next event, or None once its (non-streaming) client has disconnected.

        Nothing is written to a non-streamed response until the end, so a hang-up is only seen by
        asking; once a second is often enough (``checked[0]``: when we last asked), whether events
        keep arriving or not.
        """
        while True:
            if time.monotonic() - checked[0] >= 1.0:
                checked[0] = time.monotonic()
                if await http.is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(events.get(), timeout=1.0)
            except TimeoutError:
                continue

    async def _stream(self, request: GenerationRequest, events: asyncio.Queue, text: TextStream, shape: ResponseShape, include_usage: bool) -> AsyncIterator[str]:
        try:
            if shape.chat:
                yield _sse(shape.chunk("", first=True))  # OpenAI opens a chat stream with the role
            while True:
                event = await events.get()
                if isinstance(event, RequestFailed):
                    # The status line is sent already: the error goes in the stream, as OpenAI does.
                    yield _sse(OpenAIError(500, event.message, type="server_error").body())
                    break
                finished = event.finish_reason is not None
                new_text = text.push(event.token_ids, final=finished)
                if new_text and not (finished and not shape.chat):
                    yield _sse(shape.chunk(new_text))
                if finished:
                    # Completions carry the last text with the finish reason; chat sends an empty delta.
                    yield _sse(shape.chunk("" if shape.chat else new_text, event.finish_reason))
                    if include_usage:
                        yield _sse(shape.usage_chunk(event.stats))
                    break
            yield "data: [DONE]\n\n"
        finally:
            request.cancel()  # a client that went away stops its generation before the next round


def _sse(payload: dict) -> str:
    """One Server-Sent Event."""
    return f"data: {json.dumps(payload)}\n\n"


def _authorization(api_key: str | None):  # noqa: ANN202 - a FastAPI dependency
    expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def authorize(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):  # constant time: no key guessing by timing
            raise OpenAIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")

    return authorize


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, error: OpenAIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        problem = error.errors()[0] if error.errors() else {"msg": "invalid request", "loc": ()}
        if problem.get("type") == "json_invalid":
            return JSONResponse(OpenAIError(400, f"the body is not valid JSON: {problem.get('ctx', {}).get('error', problem['msg'])}").body(), status_code=400)
        location = [str(part) for part in problem.get("loc", ()) if part != "body"]
        # The top-level field is the param; deeper parts (list indices, the union member pydantic
        # tried, like "list[int]") only go in the message.
        param = location[0] if location else None
        message = str(problem["msg"]).removeprefix("Value error, ")
        return JSONResponse(OpenAIError(400, f"{'.'.join(location) or 'body'}: {message}", param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(OpenAIError(error.status_code, str(error.detail), code=None).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse(OpenAIError(500, f"internal error: {type(error).__name__}", type="server_error").body(), status_code=500)


class _CountRequests:
    """Pure ASGI middleware counting responses by endpoint and status (streams pass through untouched)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:  # noqa: ANN001 - an ASGI app
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - the ASGI interface
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            endpoint = scope["path"] if scope["path"] in _ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
