"""``jmtp serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`AsyncLLMEngine`.

Endpoints (OpenAI API reference, https://platform.openai.com/docs/api-reference):

* ``POST /v1/completions`` -- ``prompt`` (a string, a token-id list, or a list of either);
* ``POST /v1/chat/completions`` -- ``messages`` rendered with the model's chat template;
* both stream with ``"stream": true`` as server-sent events (``data: {json}\\n\\n`` chunks, then
  ``data: [DONE]\\n\\n``); ``stream_options.include_usage`` adds a final usage chunk;
* ``GET /v1/models``, ``GET /health`` (503 once the engine thread stopped), ``GET /metrics``
  (Prometheus text format, see :class:`ServerMetrics`).

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: a malformed or
out-of-range field is HTTP 400 ``invalid_request_error`` naming the field (pydantic validates types,
``SamplingParams`` and ``LLMEngine.add_request`` validate values); an unknown ``model`` is 404; any
other failure is a 500 for that request only. A client that disconnects has its requests aborted, so
their KV blocks are freed at the engine's next pass.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

try:  # the `serve` extra
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    import prometheus_client as prom
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("jmtp serve needs the `serve` extra: pip install 'jmtp[serve]'") from e

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.async_engine import AsyncLLMEngine, EngineDeadError
from jmtp.runtime.sampling import SamplingParams


# ---------------------------------------------------------------------------- request models
class _Base(BaseModel):
    # Clients send fields we do not use (user, logit_bias=None, ...): ignore them, as vLLM does.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


class _SamplingFields(_Base):
    """Fields shared by both endpoints (OpenAI, plus vLLM's extras top_k / min_p / ...)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(_Base):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class BadRequest(Exception):
    """An invalid request field (HTTP 400 ``invalid_request_error``)."""

    def __init__(self, message: str, param: str | None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code


def error_body(message: str, type_: str, param: str | None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def param_of(err: Exception, prompt_field: str) -> str:
    """The request field a jmtp error is about: :attr:`InvalidRequestError.field
    <jmtp.core.errors.InvalidRequestError.field>` (its ``"prompt"`` is the request's
    ``prompt_field``), else the prompt field."""
    field = getattr(err, "field", None) if isinstance(err, InvalidRequestError) else None
    return prompt_field if field in (None, "prompt") else field


# ---------------------------------------------------------------------------- metrics
class ServerMetrics:
    """Prometheus metrics of one server (own registry; no global state).

    Exposed (``/metrics``): ``jmtp_requests_total{endpoint}``, ``jmtp_request_success_total
    {finish_reason}``, ``jmtp_request_errors_total{status}``, ``jmtp_prompt_tokens_total``,
    ``jmtp_generation_tokens_total``, ``jmtp_num_requests_running``, ``jmtp_num_requests_waiting``
    (queue length), ``jmtp_kv_blocks_free``, ``jmtp_kv_blocks_total``, ``jmtp_step_seconds``
    (histogram of engine-step wall time, s), and speculation: ``jmtp_spec_decode_draft_tokens_total``,
    ``jmtp_spec_decode_accepted_tokens_total``, ``jmtp_spec_decode_accepted_per_position_total
    {position}`` (verify steps whose draft ``position`` (1-based) was accepted),
    ``jmtp_spec_decode_steps_total``, ``jmtp_spec_decode_step_tokens_total`` and
    ``jmtp_spec_decode_mean_acceptance_length`` (tokens per verify step since start). With
    ``speculation_policy="dynamic"`` also the policy's ``jmtp_spec_policy_plans_total``,
    ``jmtp_spec_policy_drafting_plans_total``, ``jmtp_spec_policy_holds_total`` and
    ``jmtp_spec_policy_host_seconds_total`` (see ``LLMEngine.get_stats``; absent stats leave
    them at 0).
    """

    def __init__(self):
        r = self.registry = prom.CollectorRegistry()
        self.requests = prom.Counter("jmtp_requests", "HTTP generation requests received",
                                     ["endpoint"], registry=r)
        self.request_success = prom.Counter("jmtp_request_success", "Completions finished",
                                            ["finish_reason"], registry=r)
        self.request_errors = prom.Counter("jmtp_request_errors", "Requests answered with an error",
                                           ["status"], registry=r)
        self.prompt_tokens = prom.Counter("jmtp_prompt_tokens", "Prompt tokens of requests that "
                                          "produced output", registry=r)
        self.generation_tokens = prom.Counter("jmtp_generation_tokens", "Generated tokens",
                                              registry=r)
        self.num_running = prom.Gauge("jmtp_num_requests_running", "Requests in engine slots",
                                      registry=r)
        self.num_waiting = prom.Gauge("jmtp_num_requests_waiting", "Requests waiting for a slot",
                                      registry=r)
        self.kv_free = prom.Gauge("jmtp_kv_blocks_free", "Free KV-cache blocks", registry=r)
        self.kv_total = prom.Gauge("jmtp_kv_blocks_total", "KV-cache blocks", registry=r)
        self.step_seconds = prom.Histogram(
            "jmtp_step_seconds", "Engine step wall time (s)", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        self.draft_tokens = prom.Counter("jmtp_spec_decode_draft_tokens", "Draft tokens verified",
                                         registry=r)
        self.accepted_tokens = prom.Counter("jmtp_spec_decode_accepted_tokens",
                                            "Draft tokens accepted", registry=r)
        self.accepted_per_position = prom.Counter(
            "jmtp_spec_decode_accepted_per_position", "Verify steps whose draft at this 1-based "
            "position was accepted", ["position"], registry=r)
        self.decode_steps = prom.Counter("jmtp_spec_decode_steps", "Verify (decode) steps of "
                                         "requests", registry=r)
        self.decode_tokens = prom.Counter("jmtp_spec_decode_step_tokens", "Tokens committed by "
                                          "verify steps", registry=r)
        self.mean_acceptance_length = prom.Gauge(
            "jmtp_spec_decode_mean_acceptance_length", "Tokens committed per verify step since "
            "start (1 = no draft accepted)", registry=r)
        self.policy_plans = prom.Counter("jmtp_spec_policy_plans", "Steps the dynamic "
                                         "speculation policy planned", registry=r)
        self.policy_drafting = prom.Counter("jmtp_spec_policy_drafting_plans", "Planned steps "
                                            "whose limits allowed a draft", registry=r)
        self.policy_holds = prom.Counter("jmtp_spec_policy_holds", "Losing windows after which "
                                         "the policy's guard held drafting off", registry=r)
        self.policy_seconds = prom.Counter("jmtp_spec_policy_host_seconds", "Host time in the "
                                           "dynamic policy (plan and bookkeeping), s", registry=r)
        self._prev: dict = {}

    def _inc_from(self, counter, stats: dict, key: str, prev_key: str | None = None) -> None:
        prev_key = prev_key or key
        cur = stats.get(key)
        if cur is None:
            return
        delta = cur - self._prev.get(prev_key, 0)
        if delta > 0:
            counter.inc(delta)
        self._prev[prev_key] = cur

    def on_step(self, stats: dict, outputs: list, step_seconds: float | None) -> None:
        """:data:`~jmtp.runtime.async_engine.StepObserver`: runs on the engine thread."""
        self.num_running.set(stats.get("num_running", 0))
        self.num_waiting.set(stats.get("num_waiting", 0))
        self.kv_free.set(stats.get("num_free_blocks", 0))
        self.kv_total.set(stats.get("num_blocks", 0))
        if step_seconds is not None:
            self.step_seconds.observe(stats.get("last_step_seconds") or step_seconds)
        self._inc_from(self.draft_tokens, stats, "num_draft_tokens")
        self._inc_from(self.accepted_tokens, stats, "num_accepted_tokens")
        self._inc_from(self.decode_steps, stats, "num_decode_steps")
        self._inc_from(self.decode_tokens, stats, "num_decode_tokens")
        self._inc_from(self.policy_plans, stats, "spec_policy_plans")
        self._inc_from(self.policy_drafting, stats, "spec_policy_drafting_plans")
        self._inc_from(self.policy_holds, stats, "spec_policy_holds")
        self._inc_from(self.policy_seconds, stats, "spec_policy_host_seconds")
        for i, c in enumerate(stats.get("accepted_per_position") or []):
            stats_i = {"c": c}
            self._inc_from(self.accepted_per_position.labels(position=str(i + 1)), stats_i, "c",
                           f"pos{i}")
        steps = stats.get("num_decode_steps") or 0
        self.mean_acceptance_length.set(stats.get("num_decode_tokens", 0) / steps if steps else 0.0)
        for out in outputs:
            for c in out.outputs:
                self.generation_tokens.inc(len(c.delta_token_ids))
                # Counted when the whole request finished (a finished sample of an n > 1
                # request reappears in later outputs until its siblings finish).
                if out.finished:
                    self.request_success.labels(finish_reason=str(c.finish_reason)).inc()

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)


# ---------------------------------------------------------------------------- helpers
def _finish_reason(reason) -> str | None:
    """OpenAI finish reasons: "stop" (EOS, stop id or stop string) and "length"."""
    return None if reason is None else ("length" if reason == "length" else "stop")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _merge(streams: list):
    """Yield ``(prompt_index, RequestOutput)`` from several output streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, s):
        try:
            async for out in s:
                await q.put((i, out))
            await q.put((i, done))
        except BaseException as e:  # noqa: BLE001 -- forwarded to the consumer
            await q.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class _Usage:
    def __init__(self):
        self.prompt = 0
        self.completion = 0

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                "total_tokens": self.prompt + self.completion}


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncLLMEngine, tokenizer, model_name: str, max_model_len: int,
                 metrics: ServerMetrics, max_logprobs: int = 0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.max_logprobs = max_logprobs

    # ---------------------------------------------------------------- request → engine
    def _check_model(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise BadRequest(f"The model `{req.model}` does not exist (this server serves "
                             f"`{self.model_name}`).", "model", status=404,
                             code="model_not_found")

    def _sampling_params(self, req, max_tokens: int | None, prompt_len: int, logprobs,
                         default_max: int | None, prompt_field: str) -> SamplingParams:
        if req.n < 1:
            raise BadRequest(f"n={req.n}: must be >= 1", "n")
        if prompt_len >= self.max_model_len:
            raise BadRequest(f"{prompt_field}: the prompt has {prompt_len} tokens; it must be "
                             f"shorter than max_model_len={self.max_model_len}", prompt_field)
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else self.max_model_len - prompt_len
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        kw: dict[str, Any] = dict(max_tokens=max_tokens, n=req.n, stop=stop)
        if req.include_stop_str_in_output:
            kw["include_stop_str_in_output"] = True
        kw["temperature"] = 1.0 if req.temperature is None else req.temperature  # OpenAI default
        for f in ("top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_tokens", "ignore_eos"):
            if getattr(req, f) is not None:
                kw[f] = getattr(req, f)
        if req.top_k is not None:
            kw["top_k"] = req.top_k
        if req.stop_token_ids:
            kw["stop_token_ids"] = tuple(req.stop_token_ids)
        if logprobs is not None:
            kw["logprobs"] = logprobs
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e), param_of(e, "prompt")) from e

    async def _submit(self, request_id: str, prompt, sp: SamplingParams, prompt_field: str):
        try:
            return await self.engine.add_request(request_id, prompt, sp)
        except EngineDeadError:
            raise
        except (ValueError, TypeError) as e:
            raise BadRequest(str(e), param_of(e, prompt_field)) from e

    def _prompt_len(self, prompt) -> int:
        return len(prompt) if isinstance(prompt, list) else len(self.tokenizer.encode(prompt))

    # ---------------------------------------------------------------- logprobs
    def _token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _completion_logprobs(self, token_ids, logprobs, offset: int) -> dict:
        toks, lps, tops, offs = [], [], [], []
        pos = offset
        for tid, d in zip(token_ids, logprobs or []):
            s = self._token_str(tid)
            toks.append(s)
            lps.append(d.get(tid))
            tops.append({self._token_str(t): v for t, v in d.items()})
            offs.append(pos)
            pos += len(s)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def _chat_logprobs(self, token_ids, logprobs, top_n: int) -> dict:
        content = []
        for tid, d in zip(token_ids, logprobs or []):
            s = self._token_str(tid)
            top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": s, "logprob": d.get(tid), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self._token_str(t), "logprob": v,
                                              "bytes": list(self._token_str(t).encode())}
                                             for t, v in top]})
        return {"content": content}

    # ---------------------------------------------------------------- completions
    async def completions(self, req: CompletionRequest, raw: Request):
        self._check_model(req)
        if req.echo:
            raise BadRequest("echo is not supported", "echo")
        if req.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise BadRequest("best_of other than n is not supported", "best_of")
        p = req.prompt
        if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise BadRequest("prompt is empty", "prompt")
        if req.logprobs is not None and req.logprobs > max(self.max_logprobs, 0):
            raise BadRequest(f"logprobs={req.logprobs} exceeds the server's max_logprobs="
                             f"{self.max_logprobs} (start it with --max-logprobs)", "logprobs")
        # OpenAI's default max_tokens for completions is 16.
        sps = [self._sampling_params(req, req.max_tokens, self._prompt_len(pr), req.logprobs,
                                     default_max=16, prompt_field="prompt") for pr in prompts]
        base = f"cmpl-{uuid.uuid4().hex}"
        return await self._serve(
            raw, req, base, prompts, sps, "prompt", "text_completion", self._completion_choice,
            self._completion_chunk_choice)

    def _completion_choice(self, idx, c, req) -> dict:
        return {"index": idx, "text": c.text,
                "logprobs": (self._completion_logprobs(c.token_ids, c.logprobs, 0)
                             if req.logprobs is not None else None),
                "finish_reason": _finish_reason(c.finish_reason), "stop_reason": c.stop_reason}

    def _completion_chunk_choice(self, idx, c, req, first: bool, offset: int) -> dict:
        return {"index": idx, "text": c.delta_text,
                "logprobs": (self._completion_logprobs(c.delta_token_ids,
                                                       (c.logprobs or [])[-len(c.delta_token_ids):]
                                                       if c.delta_token_ids else [], offset)
                             if req.logprobs is not None else None),
                "finish_reason": _finish_reason(c.finish_reason), "stop_reason": c.stop_reason}

    # ---------------------------------------------------------------- chat
    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self._check_model(req)
        msgs = []
        for i, m in enumerate(req.messages):
            content = m.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            msgs.append({"role": m.role, "content": content or ""})
        try:
            prompt = self.tokenizer.apply_chat_template(msgs)
        except Exception as e:  # noqa: BLE001 -- template errors are the request's fault
            raise BadRequest(f"messages: cannot apply the chat template: {e}", "messages") from e
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
            if top > self.max_logprobs or self.max_logprobs == 0:
                raise BadRequest(f"logprobs need the server started with --max-logprobs >= "
                                 f"{max(top, 1)} (it has {self.max_logprobs})", "logprobs")
        elif req.top_logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        try:
            sp = self._sampling_params(req, max_tokens, self._prompt_len(prompt), top,
                                       default_max=None, prompt_field="messages")
        except BadRequest as e:
            if e.param == "max_tokens" and req.max_completion_tokens is not None:
                e.param = "max_completion_tokens"     # name the field the client sent
            raise
        base = f"chatcmpl-{uuid.uuid4().hex}"
        return await self._serve(raw, req, base, [prompt], [sp], "messages", "chat.completion",
                                 self._chat_choice, self._chat_chunk_choice)

    def _chat_choice(self, idx, c, req) -> dict:
        return {"index": idx, "message": {"role": "assistant", "content": c.text},
                "logprobs": (self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                             if req.logprobs else None),
                "finish_reason": _finish_reason(c.finish_reason), "stop_reason": c.stop_reason}

    def _chat_chunk_choice(self, idx, c, req, first: bool, offset: int) -> dict:
        delta = {"role": "assistant", "content": c.delta_text} if first else \
            ({"content": c.delta_text} if c.delta_text else {})
        lp = None
        if req.logprobs:
            n = len(c.delta_token_ids)
            lp = self._chat_logprobs(c.delta_token_ids, (c.logprobs or [])[-n:] if n else [],
                                     req.top_logprobs or 0)
        return {"index": idx, "delta": delta, "logprobs": lp,
                "finish_reason": _finish_reason(c.finish_reason), "stop_reason": c.stop_reason}

    # ---------------------------------------------------------------- shared serving
    async def _serve(self, raw: Request, req, base: str, prompts: list, sps: list,
                     prompt_field: str, obj: str, choice_fn, chunk_fn):
        n = req.n
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        streams = []
        try:
            for rid, pr, sp in zip(ids, prompts, sps):
                streams.append(await self._submit(rid, pr, sp, prompt_field))
        except BaseException:
            for rid in ids:
                await self.engine.abort(rid)
            raise
        created = int(time.time())
        head = {"id": base, "object": obj, "created": created, "model": self.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._stream(ids, streams, head, req, n, chunk_fn, include_usage),
                media_type="text/event-stream")
        return await self._until_disconnect(raw, ids, self._collect(ids, streams, head, req, n,
                                                                    choice_fn))

    async def _collect(self, ids, streams, head, req, n, choice_fn) -> dict:
        usage = _Usage()
        final: dict[int, Any] = {}
        seen = set()
        try:
            async for i, out in _merge(streams):
                if i not in seen:
                    seen.add(i)
                    usage.prompt += len(out.prompt_token_ids)
                    self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
                for c in out.outputs:
                    if c.finish_reason is not None or out.finished:
                        final[i * n + c.index] = c
        finally:
            for rid in ids:
                await self.engine.abort(rid)     # no-op for finished requests
        choices = []
        for idx in sorted(final):
            c = final[idx]
            usage.completion += len(c.token_ids)
            choices.append(choice_fn(idx, c, req))
        return dict(head, choices=choices, usage=usage.as_dict())

    async def _until_disconnect(self, raw: Request, ids, coro) -> Response:
        """Run ``coro`` unless the client disconnects first (then abort its requests)."""
        task = asyncio.ensure_future(coro)

        async def disconnected():
            while True:
                message = await raw.receive()
                if message["type"] == "http.disconnect":
                    return

        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not task.done():
            task.cancel()
            for rid in ids:
                await self.engine.abort(rid)
            with contextlib.suppress(BaseException):
                await task
            log.info("client disconnected: aborted %s", ids)
            return Response(status_code=499)
        return JSONResponse(task.result())

    async def _stream(self, ids, streams, head, req, n, chunk_fn, include_usage: bool):
        usage = _Usage()
        started: set[int] = set()
        offsets: dict[int, int] = {}
        seen = set()
        done: set[int] = set()
        finished_ok = False
        try:
            async for i, out in _merge(streams):
                if i not in seen:
                    seen.add(i)
                    usage.prompt += len(out.prompt_token_ids)
                    self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
                choices = []
                for c in out.outputs:
                    idx = i * n + c.index
                    first = idx not in started
                    if idx in done or not (first or c.delta_text or c.delta_token_ids
                                           or c.finish_reason):
                        continue    # finished samples of n > 1 reappear until all finish
                    if c.finish_reason is not None:
                        done.add(idx)
                    started.add(idx)
                    choices.append(chunk_fn(idx, c, req, first, offsets.get(idx, 0)))
                    offsets[idx] = offsets.get(idx, 0) + len(c.delta_text)
                    if c.finish_reason is not None:
                        usage.completion += len(c.token_ids)
                if choices:
                    yield _sse(dict(head, object=head["object"] + (
                        ".chunk" if head["object"] == "chat.completion" else ""), choices=choices))
            if include_usage:
                yield _sse(dict(head, object=head["object"] + (
                    ".chunk" if head["object"] == "chat.completion" else ""), choices=[],
                    usage=usage.as_dict()))
            finished_ok = True
        except asyncio.CancelledError:   # client went away (Starlette cancels the response task)
            raise
        except Exception as e:  # noqa: BLE001 -- the error goes to this stream only
            log.exception("stream %s failed", head["id"])
            self.metrics.request_errors.labels(status="500").inc()
            yield _sse(error_body(str(e), "internal_error", None))
        finally:
            for rid in ids:
                await self.engine.abort(rid)     # no-op for finished requests
            if not finished_ok:
                log.info("stream %s ended early: aborted %s", head["id"], ids)
        yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------- app
def build_app(engine: AsyncLLMEngine, tokenizer, *, model_name: str, max_model_len: int,
              metrics: ServerMetrics, max_logprobs: int = 0) -> FastAPI:
    """The FastAPI app. ``engine`` is shut down when the app's lifespan ends; ``metrics`` should be
    the engine's ``on_step`` observer."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="jmtp", lifespan=lifespan)
    serving = OpenAIServing(engine, tokenizer, model_name, max_model_len, metrics, max_logprobs)

    def err(status: int, message: str, type_: str, param, code=None) -> JSONResponse:
        metrics.request_errors.labels(status=str(status)).inc()
        return JSONResponse(error_body(message, type_, param, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request, exc: RequestValidationError):
        e = exc.errors()[0] if exc.errors() else {}
        if e.get("type") == "json_invalid":
            return err(400, f"request body is not valid JSON: {e.get('ctx', {}).get('error', '')}",
                       "invalid_request_error", None)
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc)
        return err(400, f"{where}: {e.get('msg', 'invalid request')}" if where else
                   e.get("msg", "invalid request"), "invalid_request_error", param)

    @app.exception_handler(BadRequest)
    async def on_bad_request(request, exc: BadRequest):
        return err(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(EngineDeadError)
    async def on_dead(request, exc: EngineDeadError):
        return err(503, str(exc), "service_unavailable", None)

    @app.exception_handler(Exception)
    async def on_error(request, exc: Exception):
        log.exception("request failed")
        return err(500, f"{type(exc).__name__}: {exc}", "internal_error", None)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        metrics.requests.labels(endpoint="completions").inc()
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        metrics.requests.labels(endpoint="chat").inc()
        return await serving.chat(req, raw)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "jmtp", "max_model_len": max_model_len}]}

    @app.get("/health")
    async def health():
        if engine.is_dead or not engine.is_running:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        # Gauges are refreshed by the engine thread after every step / command pass.
        return Response(metrics.render(), media_type=prom.CONTENT_TYPE_LATEST)

    return app


def serve(llm, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> int:
    """Serve ``llm`` (a :class:`jmtp.LLM`, built by the caller: ``jmtp serve`` builds it from its
    options) over the OpenAI-compatible API as ``model_name``, with uvicorn, until interrupted."""
    import uvicorn

    metrics = ServerMetrics()
    engine = AsyncLLMEngine.from_llm(llm, on_step=metrics.on_step, start=False)
    app = build_app(engine, llm.tokenizer, model_name=model_name,
                    max_model_len=llm.engine_config.max_model_len, metrics=metrics,
                    max_logprobs=llm.llm_engine.engine_config.max_logprobs)
    log.info("serving %s on http://%s:%d", model_name, host, port)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
    return 0
