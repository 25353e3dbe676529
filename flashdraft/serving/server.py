"""An OpenAI-compatible HTTP server over one LLM: `flashdraft serve`.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON or SSE
streams ending with `data: [DONE]`), GET /health, GET /metrics (Prometheus text format).

How a request flows:

- The handler, on the event loop, checks the API key, parses the body, tokenizes the prompt
  and builds SamplingParams, so that every bad input is refused before it costs a queue
  slot. Shape errors (a missing field, a wrong type) answer 422; values the engine cannot
  serve (temperature < 0, an empty prompt, max_tokens beyond the context) answer 400;
  a wrong key 401; an unknown model 404; a full queue 503 with Retry-After. Every error
  body has OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
- The engine is not thread-safe, so one worker thread owns it and serves a bounded FIFO
  queue of jobs one at a time. It hands each delta back to the job's asyncio.Queue with
  `loop.call_soon_threadsafe`, and checks the job's `cancelled` flag between deltas.
- A client that goes away cancels its job: while the handler waits (queued, or for a whole
  non-streaming answer) a watcher task reads the ASGI `http.disconnect`; once an SSE stream
  has started, the response itself cancels the job when it ends early. The worker closes
  the engine's stream (which stops between two steps) and takes the next job; a job that
  is cancelled while still queued is skipped.

The tokenizer is shared by the handlers (encoding) and the worker (decoding); both only
read it, which the Rust tokenizers allow from several threads at once.

Under tensor parallelism (`flashdraft serve --tensor-parallel N` under torchrun) rank 0 runs
the server, and its worker leads each job on every rank (`parallel.Lockstep`): the other
ranks run no server, only the steps rank 0 announces. A request refused by a handler never
reaches the worker, so it is never announced; a job cancelled while queued is skipped before
it is; one cancelled while running ends on every rank between two steps. Shutting the server
down tells the other ranks to leave once the worker has stopped.
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import queue
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..config import SamplingParams

log = logging.getLogger("flashdraft.serving.server")
RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait


@dataclass(frozen=True)
class ServerSettings:
    """What `flashdraft serve` adds to the engine's settings (--host and --port go to serve())."""
    served_model_name: str  # the `model` clients send and /v1/models lists
    api_key: str | None = None  # when set, every /v1 route needs `Authorization: Bearer KEY`
    max_queue: int = 64  # requests waiting behind the running one; more are refused with 503

    def __post_init__(self):
        if not self.served_model_name:
            raise ValueError("served_model_name is empty; give a name, or leave it out to use "
                             "--model")
        if not isinstance(self.max_queue, int) or self.max_queue < 1:
            raise ValueError(f"max_queue must be a whole number >= 1, got {self.max_queue!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key is empty; give a key or leave it out to serve without one")


# -- errors ----------------------------------------------------------------------------------

class ApiError(Exception):
    """An error answered as OpenAI does: status code plus {"error": {...}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# Fields whose name SamplingParams puts first in its error messages.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "stop_token_ids")


def _param_error(e: ValueError) -> ApiError:
    word = str(e).split(" ", 1)[0]
    return ApiError(400, str(e), word if word in _SAMPLING_FIELDS else None)


def _validation_error(e: ValidationError) -> ApiError:
    """Pydantic's errors as one message naming each field, e.g. `messages[0].role`."""
    def path(loc) -> str:
        return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")

    errors = e.errors(include_url=False)
    message = "; ".join(f"{path(err['loc'])}: {err['msg']}" for err in errors)
    return ApiError(422, f"invalid request body: {message}", path(errors[0]["loc"]) or None)


# -- request bodies --------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class GenerationRequest(BaseModel):
    """Fields common to both generation routes; unknown fields are ignored, as OpenAI's
    clients send many."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None  # an extension, as in vLLM
    min_p: float | None = None  # an extension, as in vLLM
    seed: int | None = None
    stop: Any = None  # a string or a list of strings; SamplingParams checks it
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool | None = False  # extension
    stream: bool | None = False  # clients may send null for any optional field
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, message) for each option asked for that this server does not do."""
        out = []
        if self.n not in (None, 1):
            out.append(("n", f"n={self.n}: this server returns one choice per request; use n=1 "
                              f"and send several requests instead"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                out.append((name, f"{name}={getattr(self, name)} is not supported; use 0"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported; leave it out"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options is only allowed with stream=true"))
        return out


class CompletionRequest(GenerationRequest):
    prompt: Any  # a string, a list of token ids, or a list holding one of those
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self):
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "echo is not supported; leave it out"))
        if self.logprobs is not None:
            out.append(("logprobs", "logprobs are not supported; leave them out"))
        if self.best_of not in (None, 1):
            out.append(("best_of", f"best_of={self.best_of} is not supported; use 1"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported; leave it out"))
        return out


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Any = None  # a string, or a list of {"type": "text", "text": ...} parts


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported(self):
        out = super().unsupported()
        if self.logprobs or self.top_logprobs is not None:
            out.append(("logprobs", "logprobs are not supported; leave them out"))
        return out


# -- the worker ------------------------------------------------------------------------------

CANCELLED = object()  # the last item of a job that ended because its client went away


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    items: asyncio.Queue  # StreamDelta ..., then a final delta, an Exception or CANCELLED
    arrival: float  # time.perf_counter() when the request came in
    cancelled: bool = False  # set by the handler's side, read by the worker between deltas

    def post(self, item) -> None:
        """From the worker thread to the handler's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is going down
            self.cancelled = True


class Worker:
    """The one thread that runs the engine, serving a bounded FIFO queue of jobs."""

    def __init__(self, llm, max_queue: int, metrics: "ServerMetrics", lockstep=None):
        self.llm, self.metrics, self.max_queue = llm, metrics, max_queue
        self.lockstep = lockstep  # parallel.Lockstep on rank 0 of a tensor-parallel LLM
        # Unbounded underneath: the limit is checked in submit() (the event loop is the only
        # producer, so checking then putting cannot race), and stop() can always add its None.
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.running: Job | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="flashdraft-engine", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def submit(self, job: Job) -> None:
        if not self.alive():
            raise ApiError(503, "the engine worker is not running; the server is starting or "
                                "going down", code="engine_unavailable")
        if self.queue.qsize() >= self.max_queue:
            raise ApiError(503, f"the server is busy: {self.max_queue} requests are already "
                                f"waiting (--max-queue); retry after {RETRY_AFTER_S} s",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.queue.put_nowait(job)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is queued or running and let the thread end."""
        self.stopping = True
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled = True
                job.post(CANCELLED)
        if self.running is not None:
            self.running.cancelled = True
        self.queue.put(None)
        if self.thread is not None:
            # The other ranks of a tensor-parallel LLM leave only when the worker, once its
            # step is done, tells them: waiting is the only way not to strand them.
            self.thread.join(None if self.lockstep is not None else timeout)

    def _loop(self) -> None:
        while (job := self.queue.get()) is not None:
            if job.cancelled or self.stopping:  # its client left while it waited
                job.post(CANCELLED)
                self.metrics.finished.labels("cancelled").inc()
                continue
            self.running = job
            try:
                self._run(job)
            except Exception:  # never let one request take the server down
                log.exception("the worker failed outside a request")
            finally:
                self.running = None
        if self.lockstep is not None:  # after the last step: no word of the worker's follows
            self.lockstep.stop()
        try:  # on the engine's own thread, after its last step: the step costs it measured
            self.llm.close()
        except Exception:
            log.exception("could not save the step costs")

    def _run(self, job: Job) -> None:
        m = self.metrics
        m.prompt_tokens.inc(len(job.prompt_ids))
        stream = (self.lockstep.lead(job.prompt_ids, job.params) if self.lockstep is not None
                  else self.llm.stream({"prompt_token_ids": job.prompt_ids}, job.params))
        first = True
        try:
            for delta in stream:
                if first:
                    m.ttft.observe(time.perf_counter() - job.arrival)
                    first = False
                m.generation_tokens.inc(len(delta.token_ids))
                job.post(delta)
                if delta.output is not None:
                    m.record_finished(delta.output, time.perf_counter() - job.arrival)
                    return
                if job.cancelled:
                    break
            job.post(CANCELLED)
            m.finished.labels("cancelled").inc()
        except Exception as e:
            if not isinstance(e, (ValueError, TypeError)):
                log.exception("request failed in the engine")
            job.post(e)
            m.finished.labels("error").inc()
        finally:
            stream.close()  # stops the engine between two steps when the client went away


# -- metrics ---------------------------------------------------------------------------------

_ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120, 300)
_TPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1)
_TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 65)


class ServerMetrics:
    """Prometheus series, in a registry of this server's own (not the process-global one)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("flashdraft_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.finished = Counter("flashdraft_request_finished",
                                "generations by how they ended: stop, length, cancelled, error",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("flashdraft_prompt_tokens", "prompt tokens prefilled",
                                     registry=r)
        self.generation_tokens = Counter("flashdraft_generation_tokens", "tokens generated",
                                         registry=r)
        self.ttft = Histogram("flashdraft_time_to_first_token_seconds",
                              "time from arrival to the first token, queueing included",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("flashdraft_time_per_output_token_seconds",
                              "decode time per token after the first, per request",
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("flashdraft_e2e_request_latency_seconds",
                             "time from arrival to the last token", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.drafted = Counter("flashdraft_draft_tokens", "tokens proposed by the drafter",
                               registry=r)
        self.accepted = Counter("flashdraft_accepted_tokens",
                                "drafted tokens the target accepted", registry=r)
        # Acceptance at draft position i is accepted{i} / drafted{i}; counters (rather than a
        # gauge of the latest request) aggregate correctly across requests and scrapes.
        self.position_drafted = Counter("flashdraft_draft_position_drafted",
                                        "speculative steps that drafted position i (1-based)",
                                        ["position"], registry=r)
        self.position_accepted = Counter("flashdraft_draft_position_accepted",
                                         "speculative steps that accepted position i (1-based)",
                                         ["position"], registry=r)
        self.tau = Histogram("flashdraft_tau", "mean accepted length per target pass (tau), "
                                               "per request", buckets=_TAU_BUCKETS, registry=r)
        self.queue_length = Gauge("flashdraft_queue_length", "requests waiting for the engine",
                                  registry=r)
        self.running = Gauge("flashdraft_requests_running", "requests the engine is running "
                                                            "(0 or 1)", registry=r)

    def record_finished(self, out, e2e_s: float) -> None:
        m = out.metrics
        self.finished.labels(out.finish_reason).inc()
        self.e2e.observe(e2e_s)
        if m.generated_tokens > 1:
            self.tpot.observe(m.tpot_s)
        if m.target_passes:
            self.tau.observe(m.tau)
        self.drafted.inc(m.drafted_tokens)
        self.accepted.inc(m.accepted_tokens)
        for i in range(max(m.drafted_per_step, default=0)):
            pos = str(i + 1)
            self.position_drafted.labels(pos).inc(sum(k > i for k in m.drafted_per_step))
            self.position_accepted.labels(pos).inc(sum(n > i for n in m.accepted_per_step))


class CountRequests:
    """ASGI middleware counting responses by route and status once they have been sent.

    Plain ASGI rather than BaseHTTPMiddleware, which would get between a streaming response
    and the client's disconnect.
    """

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # what the client gets when the app raises before answering

        async def send_counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            route = scope["path"] if scope["path"] in _ROUTES else "other"
            self.metrics.requests.labels(route, str(status)).inc()


# -- the app ---------------------------------------------------------------------------------

def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _JobStream(StreamingResponse):
    """An SSE response that cancels its job however it ends (a client gone mid-stream)."""

    def __init__(self, content, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancelled = True  # a no-op once the job has finished


def create_app(llm, settings: ServerSettings, lockstep=None) -> FastAPI:
    """The ASGI app over `llm` (an api.LLM); the engine worker runs while the app does.
    lockstep: rank 0's parallel.Lockstep where `llm` is tensor-parallel (`serve` makes it)."""
    metrics = ServerMetrics()
    worker = Worker(llm, settings.max_queue, metrics, lockstep)
    metrics.queue_length.set_function(worker.queue.qsize)
    metrics.running.set_function(lambda: 0 if worker.running is None else 1)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="flashdraft", version=__version__, lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.settings = worker, metrics, settings
    app.add_middleware(CountRequests, metrics=metrics)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        message = f"{request.method} {request.url.path}: {e.detail}"
        if e.status_code == 404:
            message += f"; the routes are {', '.join(_ROUTES)}"
        return ApiError(e.status_code, message, headers=e.headers).response()

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        log.exception("unexpected error")
        return ApiError(500, f"internal error: {type(e).__name__}: {e}",
                        code="internal_error").response()

    def require_key(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "no API key: send the header `Authorization: Bearer <key>`",
                           code="invalid_api_key")
        if not secrets.compare_digest(key.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "incorrect API key provided", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    async def parse(request: Request, model: type[GenerationRequest]) -> GenerationRequest:
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}")
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got "
                                f"{type(data).__name__}")
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise _validation_error(e)
        if req.model is not None and req.model != settings.served_model_name:
            raise ApiError(404, f"the model `{req.model}` does not exist; this server serves "
                                f"`{settings.served_model_name}`", "model", "model_not_found")
        if unsupported := req.unsupported():
            field, message = unsupported[0]
            raise ApiError(400, message, field)
        return req

    def sampling(req: GenerationRequest, prompt_ids: list[int], prompt_field: str,
                 max_field: str, asked: int | None, default: int | None) -> SamplingParams:
        if asked is not None and asked < 1:
            raise ApiError(400, f"{max_field} must be a whole number >= 1, got {asked}", max_field)
        if req.seed is not None and not -2**63 <= req.seed < 2**64:
            raise ApiError(400, f"seed must be in [-2**63, 2**64), got {req.seed}", "seed")
        try:
            params = SamplingParams(
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0, min_p=req.min_p or 0.0, seed=req.seed, stop=req.stop,
                stop_token_ids=req.stop_token_ids, ignore_eos=bool(req.ignore_eos))
        except ValueError as e:
            raise _param_error(e)
        try:
            llm.check_fits(prompt_ids)
        except ValueError as e:
            raise ApiError(400, str(e), prompt_field)
        room = llm.max_model_len - len(prompt_ids)
        if asked is not None and asked > room:
            raise ApiError(400, f"{max_field}={asked} is beyond the context: the prompt has "
                                f"{len(prompt_ids)} tokens and max_model_len is "
                                f"{llm.max_model_len}, so at most {room} tokens can be "
                                f"generated; lower {max_field} or shorten the prompt", max_field)
        return dataclasses.replace(params, max_tokens=asked or min(default or room, room))

    async def run(request: Request, req: GenerationRequest, prompt_ids: list[int],
                  params: SamplingParams, chat: bool, arrival: float):
        """Queue the job, then answer with JSON or an SSE stream."""
        job = Job(prompt_ids, params, asyncio.get_running_loop(), asyncio.Queue(), arrival)
        worker.submit(job)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": settings.served_model_name}

        # Until the answer (or the first delta of a stream) is in, watch for the client
        # leaving: nothing else reads the connection meanwhile.
        async def watch():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            job.cancelled = True
            job.items.put_nowait(CANCELLED)

        watcher = asyncio.create_task(watch())
        done = False
        try:
            while True:
                item = await job.items.get()
                if item is CANCELLED:
                    # 499 (nginx's "client closed request"): only the metrics see it.
                    raise ApiError(499, "the client closed the request", code="cancelled")
                if isinstance(item, Exception):
                    raise _engine_error(item)
                if req.stream or item.output is not None:
                    break
            done = True
        finally:
            watcher.cancel()
            await asyncio.wait([watcher])
            if not done:
                job.cancelled = True

        if not req.stream:
            out = item.output
            choice = {"index": 0, "logprobs": None, "finish_reason": out.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            return JSONResponse({**head, "choices": [choice],
                                 "usage": _usage(len(prompt_ids), len(out.token_ids))})

        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", **delta}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None,
                          "finish_reason": finish}
            body = {**head, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return _sse(body)

        async def events(item):
            if chat:
                yield chunk("", None, role=True)
            while True:
                if item is CANCELLED:
                    return
                if isinstance(item, Exception):
                    yield _sse(_engine_error(item).body())
                    break
                if item.text:
                    yield chunk(item.text, None)
                if item.output is not None:
                    yield chunk(None, item.output.finish_reason)
                    if include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(
                            len(prompt_ids), len(item.output.token_ids))})
                    break
                item = await job.items.get()
            yield "data: [DONE]\n\n"

        return _JobStream(events(item), job)

    @v1.get("/models")
    async def list_models():
        return {"object": "list", "data": [{
            "id": settings.served_model_name, "object": "model", "created": created,
            "owned_by": "flashdraft", "root": llm.config.model,
            "max_model_len": llm.max_model_len}]}

    @v1.post("/completions")
    async def completions(request: Request):
        arrival = time.perf_counter()
        req = await parse(request, CompletionRequest)
        ids = _completion_prompt(llm, req.prompt)
        params = sampling(req, ids, "prompt", "max_tokens", req.max_tokens, 16)
        return await run(request, req, ids, params, False, arrival)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.perf_counter()
        req = await parse(request, ChatRequest)
        messages = _chat_messages(req.messages)
        try:
            ids = llm.chat_prompt_ids(messages)
        except (ValueError, TemplateError) as e:  # the template may refuse, e.g. a role order
            message = str(e) if str(e).startswith("messages") else f"messages: {e}"
            raise ApiError(400, message, "messages")
        # OpenAI's newer name wins; errors name whichever field the client used.
        max_field, asked = "max_tokens", req.max_tokens
        if req.max_completion_tokens is not None:
            max_field, asked = "max_completion_tokens", req.max_completion_tokens
        params = sampling(req, ids, "messages", max_field, asked, None)
        return await run(request, req, ids, params, True, arrival)

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if not worker.alive():
            raise ApiError(503, "the engine worker is not running", code="engine_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _engine_error(e: Exception) -> ApiError:
    """The engine refuses bad input with ValueError / TypeError; anything else is our bug."""
    if isinstance(e, (ValueError, TypeError)):
        return _param_error(e) if isinstance(e, ValueError) else ApiError(400, str(e))
    return ApiError(500, f"the engine failed: {type(e).__name__}: {e}", code="internal_error")


def _completion_prompt(llm, prompt) -> list[int]:
    """The one prompt of a /v1/completions body, as token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    is_id = lambda t: isinstance(t, int) and not isinstance(t, bool)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list))
                                                             for p in prompt):
        raise ApiError(400, f"prompt holds {len(prompt)} prompts; this server takes one prompt "
                            f"per request: send several requests instead", "prompt")
    if prompt == "" or prompt == []:
        raise ApiError(400, "prompt is empty; give at least one character or token id", "prompt")
    if isinstance(prompt, str):
        return llm.encode(prompt)[1]
    if isinstance(prompt, list) and all(is_id(t) for t in prompt):
        try:
            return llm.encode({"prompt_token_ids": prompt})[1]
        except ValueError as e:
            raise ApiError(400, f"prompt: {e}", "prompt")
    raise ApiError(400, f"prompt must be a string, a list of token ids, or a list holding one "
                        f"of those; got {json.dumps(prompt)[:80]}", "prompt")


def _chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages for the chat template: role and text content (text parts are joined)."""
    out = []
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = [p.get("text") for p in content
                     if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                raise ApiError(400, f"messages[{i}].content: only text parts "
                                    f"({{\"type\": \"text\", \"text\": ...}}) are supported",
                               f"messages[{i}].content")
            content = "".join(texts)
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts, "
                                f"got {type(content).__name__}", f"messages[{i}].content")
        out.append({"role": m.role, "content": content})
    return out


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def serve(llm, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Run the server until interrupted (Ctrl-C or SIGTERM). On the ranks of a tensor-parallel
    `llm` (every one calls this): rank 0 serves, the others follow its steps until it stops."""
    import uvicorn

    lockstep = None
    if llm.parallel is not None:
        from ..parallel import Lockstep

        lockstep = Lockstep(llm)
        if llm.rank != 0:
            _follow(lockstep)
            return
    if not _is_loopback(host) and settings.api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach this address can "
                    "use the model", host)
    app = create_app(llm, settings, lockstep)
    # A bounded graceful shutdown: streams still open after it are cut, not waited for.
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def _follow(lockstep) -> None:
    """A follower's part of `serve`. Ctrl-C (which a terminal sends to every rank) and
    torchrun's SIGTERM are rank 0's to act on: its server shuts down and then tells this rank
    to leave, which a follower that died first would leave it unable to do."""
    import signal

    kept = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        lockstep.follow()
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
