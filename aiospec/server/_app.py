"""The OpenAI-compatible HTTP app: a lean ASGI front for the generate routes, Starlette for the rest.

``create_app`` builds an ``_App``: its ``Handlers`` hold the server's ``AppState`` and have one
method per route. ``POST /v1/chat/completions`` and ``POST /v1/completions`` are dispatched
straight on ASGI, so that no middleware layer sits between each SSE chunk and the socket (the
same endpoints are Starlette routes too, which answer any other method with 405); a request
that passes its checks runs to the end as a ``Generation`` (``_generation.py``).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

import aiospec
from aiospec.openai import PromptLogprobs
from aiospec.server._drain import Drain
from aiospec.server._engine_link import EngineLink, ServerSettings
from aiospec.server._generation import Choice, Generation, send_json
from aiospec.server._guard import Guard, check_json_content_type
from aiospec.server._metrics import Metrics
from aiospec.server._output import Output
from aiospec.server._pacer import Pacer
from aiospec.server._requests import (
    ApiError,
    Limits,
    Parsed,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_tokenize,
)

__all__ = ("AppState", "create_app")

log = logging.getLogger("aiospec.server")

MAX_BODY = 1 << 20
_encoder = msgspec.json.Encoder()

_Metric = tuple[str, str, str, float, dict[str, str] | None]  # name, type, help, value, labels


class AppState:
    """What one server process's handlers share: settings, the engine link, metrics, pacer,
    and its graceful stop (``drain``)."""

    def __init__(
        self,
        settings: ServerSettings,
        on_ready: Callable[[], None] | None,
        on_fatal: Callable[[str], None] | None = None,
        drain: Drain | None = None,
    ) -> None:
        self.settings = settings
        self.drain = drain or Drain()
        self.link = EngineLink(settings)
        self.link.on_fatal = on_fatal
        self.metrics = Metrics()
        self.metrics.loop_lag.interval = settings.loop_lag_interval
        self.metrics.loop_lag.manage_gc = settings.manage_gc
        self.pacer = Pacer(settings.loop_budget, stream_deadline=settings.stream_deadline)
        self.on_ready = on_ready
        self.limits = Limits(
            max_model_len=settings.max_model_len,
            default_max_tokens=settings.default_max_tokens,
            max_logprobs=settings.max_logprobs,
            vocab_size=len(self.link.vocab),
        )


def _json(obj: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(obj), status_code=status, media_type="application/json")


class _ClientGone(Exception):
    pass


class Handlers:
    """The routes of one app over its ``AppState``: one method each, plus the lifespan."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    # -- the generate routes (raw ASGI) -------------------------------------------------------

    async def generate(self, scope: Scope, receive: Receive, send: Send, chat: bool | None) -> None:
        """POST /v1/chat/completions (``chat``), /v1/completions and /invocations (``chat``
        None: either, by the body): check and admit the request, then run it as a
        ``Generation``; errors before that answer with JSON."""
        st = self.state
        t_start = time.perf_counter()
        endpoint = "chat" if chat else "completions" if chat is not None else "invocations"
        try:
            check_json_content_type(scope["headers"])
            body = await self._read_body(scope, receive)
            if chat is None:
                chat = _invocation_is_chat(body)
                endpoint = "chat" if chat else "completions"
            # a burst of new requests is set up a few per loop iteration, within the share of
            # the budget that leaves the running streams their turns
            await st.pacer.admission()
            if st.drain.stopping:
                raise st.drain.refusal()
            t0 = time.perf_counter()
            parse = parse_chat if chat else parse_completion
            parsed = parse(body, st.limits)
            self._check_model(parsed.model)
            if not st.link.alive:
                raise ApiError(503, f"the engine is not running ({st.link.condition})", code="engine_unavailable")
            choices = self._admit(parsed, chat)
            st.pacer.charge(time.perf_counter() - t0, admission=True)
        except _ClientGone:
            st.metrics.request_done(endpoint, 499)
            return
        except ApiError as exc:
            st.metrics.request_done(endpoint, exc.status)
            await send_json(send, exc.status, exc.body())
            return
        except Exception as exc:
            log.exception("%s request failed", endpoint)
            st.metrics.request_done(endpoint, 500)
            err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
            await send_json(send, 500, err.body())
            return
        gen = Generation(st, chat=chat, parsed=parsed, choices=choices, t_start=t_start)
        await gen(scope, receive, send)

    def _admit(self, parsed: Parsed, chat: bool) -> list[Choice]:
        """Tokenize and check every prompt, then admit one engine request per choice (prompt
        by prompt, n each); if one admission fails, those made are taken back."""
        st = self.state
        s = st.settings
        vocab = st.link.vocab
        plans: list[tuple[int, str, list[int], int]] = []  # prompt index, text, ids, max_tokens
        for i, pr in enumerate(parsed.prompts):
            if pr.ids is None:
                assert pr.text is not None
                ids, text = vocab.encode(pr.text), pr.text
            else:
                ids, text = pr.ids, vocab.decode(pr.ids)
            if not ids:
                raise ApiError(400, "Invalid 'prompt': the prompt is empty (expected at least one token).",
                               param="prompt", code="empty_prompt")  # fmt: skip
            room = s.max_model_len - len(ids)
            if room < 1 and parsed.max_tokens != 0:
                param = "messages" if chat else "prompt"
                raise ApiError(
                    400, f"Invalid '{param}': {len(ids)} prompt tokens leave no room for output in the "
                    f"context length {s.max_model_len}.", param=param, code="context_length_exceeded",
                )  # fmt: skip
            if parsed.max_tokens is None:
                # min_tokens asks for that many at least (the engine refuses min_tokens > max_tokens)
                max_tokens = min(max(s.default_max_tokens, parsed.min_tokens), room)
                if parsed.min_tokens > max_tokens:
                    raise ApiError(
                        400, f"Invalid 'min_tokens': {len(ids)} prompt tokens + min_tokens = {parsed.min_tokens} "
                        f"exceeds the context length {s.max_model_len}.", param="min_tokens",
                        code="context_length_exceeded",
                    )  # fmt: skip
            else:
                max_tokens = parsed.max_tokens
                if max_tokens > room:
                    raise ApiError(
                        400,
                        f"Invalid 'max_tokens': {len(ids)} prompt tokens + max_tokens = {max_tokens} "
                        f"exceeds the context length {s.max_model_len}.",
                        param="max_tokens", code="context_length_exceeded",
                    )  # fmt: skip
            plans.append((i, text, ids, max_tokens))
        wants_prompt = parsed.engine_prompt_logprobs >= 0
        self._check_engine(parsed, wants_prompt)
        choices: list[Choice] = []
        try:
            for i, text, ids, max_tokens in plans:
                for j in range(parsed.n):
                    sampling = parsed.sampling(j)
                    # max_tokens = 0 (echo only): one token is decoded, and not shown
                    handle, stream = st.link.submit(ids, max(1, max_tokens), sampling)
                    out = Output(
                        chat, parsed, vocab, display=st.link.token_id_strings if parsed.token_ids_as_strings else None,
                        max_tokens=max_tokens, text_offset=len(text) if parsed.echo else 0,
                    )  # fmt: skip
                    choices.append(
                        Choice(
                            index=len(choices), prompt_index=i, prompt_text=text, prompt_ids=ids, handle=handle,
                            stream=stream, out=out, prompt_lp=PromptLogprobs(ids) if wants_prompt else None,
                        )
                    )  # fmt: skip
        except BaseException:
            for c in choices:
                c.stream.close()
                st.link.finish(c.handle, abort=True)
            raise
        return choices

    def _check_engine(self, parsed: Parsed, wants_prompt: bool) -> None:
        """What the engines cannot give: prompt and draft records travel on the ring only, and
        draft proposals need speculative decoding."""
        cfg = self.state.settings.engine
        asked = [("prompt_logprobs" if parsed.prompt_logprobs >= 0 else "echo", wants_prompt),
                 ("include_draft_logprobs", parsed.draft_logprobs)]  # fmt: skip
        for param, on in asked:
            if on and cfg.transport != "ring":
                raise ApiError(400, f"Invalid '{param}': the {cfg.transport} token path carries output tokens only "
                               "(the ring carries prompt and draft logprobs).", param=param,
                               code="unsupported_parameter")  # fmt: skip
        if parsed.draft_logprobs and cfg.num_draft == 0:
            msg = "Invalid 'include_draft_logprobs': the engine does no speculative decoding (--num-draft 0)."
            raise ApiError(400, msg, param="include_draft_logprobs", code="unsupported_parameter")

    def _check_model(self, model: str | None) -> None:
        name = self.state.settings.model
        # an empty name is the served model, as no name is (vLLM takes both for its default)
        if model and model != name:
            raise ApiError(
                404, f"The model `{model}` does not exist (this server has `{name}`).",
                param="model", code="model_not_found",
            )  # fmt: skip

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        """The request body, at most ``MAX_BODY`` bytes (413 past it, before reading it all)."""
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > MAX_BODY:
                msg = f"request body of {int(v)} bytes: expected at most {MAX_BODY}"
                raise ApiError(413, msg, code="body_too_large")
        parts: list[bytes] = []
        n = 0
        while True:
            event = await receive()
            if event["type"] == "http.disconnect":
                raise _ClientGone()
            body = event.get("body", b"")
            n += len(body)
            if n > MAX_BODY:
                raise ApiError(413, f"request body of {n}+ bytes: expected at most {MAX_BODY}", code="body_too_large")
            parts.append(body)
            if not event.get("more_body", False):
                return b"".join(parts)

    # -- the Starlette routes ------------------------------------------------------------------

    def _card(self) -> dict[str, Any]:
        s = self.state.settings
        return {"id": s.model, "object": "model", "created": 0, "owned_by": "aiospec", "root": s.model,
                "parent": None, "max_model_len": s.max_model_len}  # fmt: skip

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the one model this server has."""
        return _json({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: its card, or 404 for any other name."""
        name = request.path_params["model"]
        if name != self.state.settings.model:
            err = ApiError(404, f"The model `{name}` does not exist (this server has `{self.state.settings.model}`).",
                           param="model", code="model_not_found")  # fmt: skip
            return Response(err.body(), status_code=404, media_type="application/json")
        return _json(self._card())

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize (vLLM's route): the token ids of a ``prompt``, or of chat ``messages``
        through the chat template, with ``count`` and ``max_model_len`` (``token_strs`` with
        ``return_token_strs``)."""
        try:
            check_json_content_type(request.headers.raw)
            req, text = parse_tokenize(await self._read_body(request.scope, request.receive))
            self._check_model(req.model)
        except ApiError as err:
            return Response(err.body(), status_code=err.status, media_type="application/json")
        except _ClientGone:
            return Response(status_code=499)  # (nobody reads it: the client left mid-body)
        vocab = self.state.link.vocab
        ids = vocab.encode(text)
        strs = [vocab.token(i) for i in ids] if req.return_token_strs else None
        return _json({"count": len(ids), "max_model_len": self.state.settings.max_model_len, "tokens": ids,
                      "token_strs": strs})  # fmt: skip

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize (vLLM's route): ``{"prompt": text}`` of the ``tokens`` given."""
        vocab = self.state.link.vocab
        try:
            check_json_content_type(request.headers.raw)
            req = parse_detokenize(await self._read_body(request.scope, request.receive), len(vocab))
            self._check_model(req.model)
        except ApiError as err:
            return Response(err.body(), status_code=err.status, media_type="application/json")
        except _ClientGone:
            return Response(status_code=499)  # (nobody reads it: the client left mid-body)
        return _json({"prompt": vocab.decode(req.tokens)})

    async def version(self, request: Request) -> Response:
        """GET /version: ``{"version": <aiospec's version>}`` (vLLM's route)."""
        return _json({"version": aiospec.__version__})

    async def health(self, request: Request) -> Response:
        """GET /health: 200 ``ok`` while a request admitted now can get its tokens, 503 with the
        engine's state otherwise (``engine stalled``, ``engine down``, ``engine starting``,
        ``engine failed``)."""
        state = self.state.link.condition
        if state == "up":
            return Response(b"ok", media_type="text/plain")
        return Response(f"engine {state}".encode(), status_code=503, media_type="text/plain")

    async def metrics(self, request: Request) -> Response:
        """GET /metrics: Prometheus text, the server's metrics with the Hub's and the engines'."""
        st = self.state
        extra = self._hub_metrics() + await self._engine_metrics()
        extra.append(
            ("process_cpu_seconds_total", "counter", "CPU time of the server process.", time.process_time(), None)
        )
        extra.append(("aiospec_engine_up", "gauge", "1 while requests can be admitted, 0 otherwise.",
                      int(st.link.alive), None))  # fmt: skip
        extra.append(
            ("aiospec_engine_restarts_total", "counter", "Engine restarts after a failure.", st.link.restarts, None)
        )
        return Response(st.metrics.render(extra), media_type="text/plain; version=0.0.4")

    def _hub_metrics(self) -> list[_Metric]:
        hs = self.state.link.source_stats()
        if hs is None or not hasattr(hs, "records_dropped"):
            return []
        extra: list[_Metric] = [
            ("aiospec_hub_records_dropped_total", "counter", "Records for handles with no open stream.",
             hs.records_dropped, None),
            ("aiospec_hub_frames_read_total", "counter", "Frames read from the rings.", hs.frames_read, None),
            ("aiospec_hub_frames_lost_total", "counter", "Frames lost (ring losses, bad frames, evictions).",
             hs.frames_lost, None),
            ("aiospec_hub_records_routed_total", "counter", "Records routed to streams.", hs.records_routed, None),
        ]  # fmt: skip
        for r in hs.rings:
            extra.append(
                ("aiospec_ring_lag_bytes", "gauge", "Bytes written to a ring and not yet read by this server.",
                 -1 if r.lag_bytes is None else r.lag_bytes, {"ring": r.name})
            )  # fmt: skip
        return extra

    async def _engine_metrics(self) -> list[_Metric]:
        extra: list[_Metric] = []
        with contextlib.suppress(Exception):
            for e in await self.state.link.engine_stats(timeout=1.0):
                lab = {"role": e.role}
                extra += [
                    ("aiospec_engine_running", "gauge", "Requests decoding in the engine.", e.running, lab),
                    ("aiospec_engine_waiting", "gauge", "Requests queued in the engine.", e.waiting, lab),
                    ("aiospec_engine_steps_total", "counter", "Decoding steps.", e.steps, lab),
                    ("aiospec_engine_tokens_total", "counter", "Tokens decoded.", e.tokens, lab),
                ]
        return extra

    async def stats(self, request: Request) -> Response:
        """GET /stats: one JSON object of the server's, the Hub's and the engines' counters."""
        st = self.state
        m = st.metrics
        engines: list[Any] = []
        with contextlib.suppress(Exception):
            engines = [msgspec.structs.asdict(e) for e in await st.link.engine_stats(timeout=2.0)]
        hs = st.link.source_stats()
        return _json(
            {
                "model": st.settings.model,
                "token_path": st.link.token_path,
                "pd": st.settings.pd,
                "pid": os.getpid(),
                "engine_pids": st.link.engines.pids if st.link.engines is not None else [],
                "engine_state": st.link.state,
                "engine_restarts": st.link.restarts,
                "cpu_seconds": time.process_time(),
                "tokens": m.tokens,
                "tokens_per_s": m.tokens_per_second(),
                "streams_open": m.streams_open,
                "aborted": m.aborted,
                "finished": {f"{e}:{r}": n for (e, r), n in m.finished.items()},
                "requests": {f"{e}:{s}": n for (e, s), n in m.requests.items()},
                "loop_lag": m.loop_lag.summary(),
                "pacer": st.pacer.stats(),  # this process's
                "servers": None if m.share is None else m.share.servers(),  # --api-servers: each process
                "hub": None if hs is None else msgspec.to_builtins(hs),
                "engines": engines,
            }
        )

    async def stats_reset(self, request: Request) -> Response:
        """POST /stats/reset: start the loop-lag figures afresh."""
        self.state.metrics.loop_lag.reset()
        return _json({"ok": True})

    # -- errors and lifespan -------------------------------------------------------------------

    async def api_error(self, request: Request, exc: Exception) -> Response:
        """An ``ApiError`` raised by a Starlette route, as its JSON body."""
        assert isinstance(exc, ApiError)
        self.state.metrics.request_done(request.url.path, exc.status)
        return Response(exc.body(), status_code=exc.status, media_type="application/json")

    async def http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own errors (404, 405) in the OpenAI error shape."""
        assert isinstance(exc, HTTPException)
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=str(exc.status_code))
        return Response(err.body(), status_code=exc.status_code, media_type="application/json")

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """Start the loop-lag ticker and the engines, serve, then stop both."""
        st = self.state
        beats = None
        if st.settings.heartbeat_file:  # one of several server processes: the parent watches the ticker
            from aiospec.server._multi import Heartbeats

            beats = Heartbeats(st.settings.heartbeat_file)
            index = st.settings.server_index
            beats.beat(index)
            st.metrics.loop_lag.on_tick = lambda: beats.beat(index)
        st.metrics.loop_lag.start()
        cpu: _Metric = ("process_cpu_seconds_total", "counter", "CPU time of the server process.", 0.0, None)
        st.metrics.start_share(  # several server processes: each shares its figures (_metrics.py)
            st.settings.metrics_dir, st.settings.server_index,
            lambda: [*self._hub_metrics(), (*cpu[:3], time.process_time(), None)],
        )  # fmt: skip
        try:
            await st.link.start()
        except BaseException:
            await st.metrics.stop_share()
            await st.metrics.loop_lag.stop()
            await st.link.stop()
            if beats is not None:
                beats.close()
            raise
        log.info("serving %s (token path %s, engines %s)", st.settings.model, st.link.token_path,
                 st.link.engines.pids if st.link.engines else [])  # fmt: skip
        from aiospec._cpaths import missing_c_paths

        for why in missing_c_paths():  # the same bytes, at a higher CPU cost per token
            log.warning("%s", why)
        # what startup allocated lives as long as the server: keep it out of every collection
        gc.collect()
        gc.freeze()
        if st.on_ready is not None:
            st.on_ready()
        try:
            yield
        finally:
            await st.metrics.stop_share()
            await st.metrics.loop_lag.stop()
            await st.link.stop()
            if beats is not None:
                st.metrics.loop_lag.on_tick = None
                beats.close()


class _Kind(msgspec.Struct, gc=False):
    messages: Any = msgspec.UNSET
    prompt: Any = msgspec.UNSET


_kind_decoder = msgspec.json.Decoder(_Kind)


def _invocation_is_chat(body: bytes) -> bool:
    """Which request an /invocations body is (vLLM's SageMaker route): a chat completion with
    ``messages``, a completion with ``prompt``; a 400 otherwise (a body that is not a JSON
    object is left to the completions parser, which says what is wrong)."""
    try:
        kind = _kind_decoder.decode(body)
    except msgspec.DecodeError:
        return False
    if kind.messages is not msgspec.UNSET:
        return True
    if kind.prompt is msgspec.UNSET:
        raise ApiError(400, "Invalid request: /invocations expected 'messages' (a chat completion) or 'prompt' "
                       "(a completion).", param="messages", code="missing_required_parameter")  # fmt: skip
    return False


class _Generate:
    """The ASGI endpoint of one generate route (a class, so Starlette passes it raw ASGI)."""

    __slots__ = ("_chat", "_handlers")

    def __init__(self, handlers: Handlers, *, chat: bool | None) -> None:
        self._handlers = handlers
        self._chat = chat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._handlers.generate(scope, receive, send, self._chat)


class _App:
    """The ASGI app: POSTs to a generate route go straight to its endpoint, the rest through
    Starlette (routing, exception handlers, lifespan)."""

    __slots__ = ("_generate", "handlers", "starlette")

    def __init__(self, handlers: Handlers) -> None:
        self.handlers = handlers
        chat, completions = _Generate(handlers, chat=True), _Generate(handlers, chat=False)
        either = _Generate(handlers, chat=None)
        self._generate = {"/v1/chat/completions": chat, "/v1/completions": completions, "/invocations": either}
        self.starlette = Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/invocations", either, methods=["POST"]),
                Route("/v1/models", handlers.models, methods=["GET"]),
                Route("/v1/models/{model:path}", handlers.model, methods=["GET"]),
                Route("/health", handlers.health, methods=["GET"]),
                Route("/version", handlers.version, methods=["GET"]),
                Route("/tokenize", handlers.tokenize, methods=["POST"]),
                Route("/detokenize", handlers.detokenize, methods=["POST"]),
                Route("/metrics", handlers.metrics, methods=["GET"]),
                Route("/stats", handlers.stats, methods=["GET"]),
                Route("/stats/reset", handlers.stats_reset, methods=["POST"]),
            ],
            exception_handlers={ApiError: handlers.api_error, HTTPException: handlers.http_error},
            lifespan=handlers.lifespan,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._generate.get(scope["path"])
            if endpoint is not None:
                return await endpoint(scope, receive, send)
        await self.starlette(scope, receive, send)


def create_app(
    settings: ServerSettings | None = None,
    *,
    on_ready: Callable[[], None] | None = None,
    on_fatal: Callable[[str], None] | None = None,
    drain: Drain | None = None,
) -> ASGIApp:
    """The ASGI app; its lifespan starts the engines and the token path and stops them.

    ``on_ready`` is called once the engines are up and the app can serve; ``on_fatal`` with a
    message when the engine is down for good (its restarts failed), to stop the server;
    ``drain`` is told when the server begins to stop (``Drain.begin``), and then ends the
    requests still running after the grace period.
    With ``settings.api_keys`` every path but ``settings.public_paths`` needs a key; with
    ``settings.allowed_origins`` CORS headers are sent for those origins.
    """
    settings = settings or ServerSettings()
    app: ASGIApp = _App(Handlers(AppState(settings, on_ready, on_fatal, drain)))
    if settings.api_keys:
        app = Guard(app, settings.api_keys, settings.public_paths)
    if settings.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app = CORSMiddleware(
            app,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
        )
    return app
