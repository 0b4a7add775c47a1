"""OpenAI requests → ``SamplingParams`` and engine calls; engine outputs → OpenAI responses and
server-sent-event streams (:class:`OpenAIServing`). A client that disconnects has its requests
aborted, so their KV blocks are freed at the engine's next pass. Output constraints and tools:
:mod:`~jmtp.runtime.serve.server.structured`, :mod:`~jmtp.runtime.serve.server.tools`."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jmtp.core.errors import InvalidRequestError
from jmtp.runtime.host.sampling_params import SamplingParams
from jmtp.runtime.serve.async_engine import AsyncLLMEngine, EngineDeadError
from jmtp.runtime.serve.server.intake import ServerOptions
from jmtp.runtime.serve.server.metrics import ServerMetrics
from jmtp.runtime.serve.server.protocol import (BadRequest, GenerationAborted,
                                                ChatCompletionRequest, CompletionRequest, Usage,
                                                client_message, error_body, finish_reason, param_of,
                                                sse)
from jmtp.runtime.serve.server.structured import Constraint, constraint_sources, resolve
from jmtp.runtime.serve.server.tools import ToolPlan, plan_tools

log = logging.getLogger("jmtp.runtime.serve.server")   # the server's one logger name
#: Logprobs below this (``-inf``) are sent as this value (vLLM's convention; JSON has no inf).
LOGPROB_FLOOR = -9999.0


def _check_not_aborted(c, request_id: str) -> None:
    """Raise :class:`GenerationAborted` (logged) when the engine ended sample ``c`` with
    ``finish_reason="abort"``: its output is cut short, so it is an error, not a "stop"."""
    if c.finish_reason == "abort":
        log.error("request %s sample %d: ended early: %s", request_id, c.index, c.stop_reason)
        raise GenerationAborted(c.stop_reason)


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


def max_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for: the longest token string of the
    vocabulary (added tokens included). A byte-level BPE token's string has one character per
    byte and a SentencePiece token's one per character, so a text of ``c`` characters needs at
    least ``c / max_token_chars`` tokens: the cheap bound checked before tokenizing."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "get_vocab"):
        return 1 << 20      # unknown tokenizer: no pre-check worth the name
    return max((len(t) for t in backend.get_vocab(with_added_tokens=True)), default=1)


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses.

    Everything that can take long on a large input (tokenizing, rendering the chat template,
    checking JSON schemas, compiling output constraints) runs on ``options.intake_threads``
    worker threads, not the event loop, after a cheap length check: a text longer than
    ``max_model_len * max_token_chars`` characters is refused untokenized. Prompts reach the
    engine as token ids, so its thread does not tokenize them again.
    """

    def __init__(self, engine: AsyncLLMEngine, tokenizer, model_name: str, max_model_len: int,
                 metrics: ServerMetrics, max_logprobs: int = 0,
                 options: ServerOptions | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.max_logprobs = max_logprobs
        self.options = options or ServerOptions()
        self.max_token_chars = max_token_chars(tokenizer)
        self._pool = ThreadPoolExecutor(self.options.intake_threads,
                                        thread_name_prefix="jmtp-intake")

    def close(self) -> None:
        """Stop the intake threads (queued work is dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _offload(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---------------------------------------------------------------- request → engine
    def _check_model(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise BadRequest(f"The model `{req.model}` does not exist (this server serves "
                             f"`{self.model_name}`).", "model", status=404,
                             code="model_not_found")

    def _check_common(self, req) -> None:
        """Cheap checks of either endpoint, on the event loop."""
        if req.stream_options is not None and not req.stream:
            raise BadRequest("stream_options: only allowed with \"stream\": true",
                             "stream_options")

    def _check_logprobs(self, n: int, field: str) -> None:
        if self.max_logprobs <= 0:
            raise BadRequest(f"{field}: this server returns no logprobs", field)
        if n > self.max_logprobs:
            raise BadRequest(f"{field}={n}: this server returns at most {self.max_logprobs} "
                             "logprobs per token", field)

    def _tokenize(self, text: str, field: str) -> list[int]:
        """Token ids of ``text`` (a worker thread), after the cheap length bound."""
        room = self.max_model_len - 1
        if len(text) > room * self.max_token_chars:
            raise BadRequest(f"{field}: {len(text)} characters cannot fit in the {room} prompt "
                             f"tokens max_model_len={self.max_model_len} allows (a token of this "
                             f"model covers at most {self.max_token_chars} characters)", field)
        return list(self.tokenizer.encode(text))

    def _sampling_params(self, req, max_tokens: int | None, prompt_len: int, logprobs,
                         default_max: int | None, prompt_field: str, max_tokens_field: str,
                         constraint: Constraint | None = None) -> SamplingParams:
        if prompt_len >= self.max_model_len:
            raise BadRequest(f"{prompt_field}: the prompt has {prompt_len} tokens; it must be "
                             f"shorter than max_model_len={self.max_model_len}", prompt_field)
        left = self.max_model_len - prompt_len
        if max_tokens is None:
            max_tokens = left if default_max is None else min(default_max, left)
        elif max_tokens > left:
            raise BadRequest(f"{max_tokens_field}={max_tokens} is more than the {left} tokens the "
                             f"prompt ({prompt_len} tokens) leaves of max_model_len="
                             f"{self.max_model_len}", max_tokens_field)
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
        if req.num_speculative_tokens is not None:
            kw["num_speculative_tokens"] = req.num_speculative_tokens
        if req.stop_token_ids:
            kw["stop_token_ids"] = tuple(req.stop_token_ids)
        kw["logit_bias"] = self._logit_bias(req.logit_bias)
        kw["skip_special_tokens"] = req.skip_special_tokens
        if req.prompt_logprobs is not None:
            kw["prompt_logprobs"] = req.prompt_logprobs
        if logprobs is not None:
            kw["logprobs"] = logprobs
        if constraint is not None:
            kw["structured_outputs"] = constraint.params
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            param = self._param(e, "prompt", constraint)
            raise BadRequest(client_message(e), max_tokens_field if param == "max_tokens"
                             else param) from e

    def _compile(self, constraint: Constraint | None) -> None:
        """Compile the output constraint on this (worker) thread; the engine's check at intake
        then finds it cached."""
        if constraint is None:
            return
        try:
            self.engine.compile_constraint(constraint.params)
        except InvalidRequestError as e:
            raise BadRequest(f"{constraint.param}: {client_message(e)}",
                             constraint.rename(e.field)) from e

    @staticmethod
    def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
        """OpenAI's ``logit_bias`` (JSON object keys are strings) with int token ids."""
        if bias is None:
            return None
        out = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                raise BadRequest(f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
            if token in out:
                raise BadRequest(f"logit_bias: token id {token} given twice", "logit_bias")
            out[token] = value
        return out

    @staticmethod
    def _param(err: Exception, prompt_field: str, constraint: Constraint | None) -> str | None:
        param = param_of(err, prompt_field)
        return constraint.rename(param) if constraint is not None else param

    async def _submit(self, request_id: str, prompt, sp: SamplingParams, prompt_field: str,
                      constraint: Constraint | None = None):
        try:
            return await self.engine.add_request(request_id, prompt, sp)
        except EngineDeadError:
            raise
        except (ValueError, TypeError) as e:   # grammar errors too: before the request runs
            raise BadRequest(client_message(e, request_id),
                             self._param(e, prompt_field, constraint)) from e

    # ---------------------------------------------------------------- logprobs
    @staticmethod
    def _lp(v):
        """A logprob as JSON can carry it: ``-inf`` (a token the request's mask, bad words or a
        structured-output grammar forbids) becomes vLLM's -9999.0."""
        return v if v is None or v > LOGPROB_FLOOR else LOGPROB_FLOOR

    def _token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _completion_logprobs(self, token_ids, logprobs, offset: int) -> dict:
        toks, lps, tops, offs = [], [], [], []
        pos = offset
        for tid, d in zip(token_ids, logprobs or []):
            s = self._token_str(tid)
            toks.append(s)
            lps.append(self._lp(d.get(tid)))
            tops.append({self._token_str(t): self._lp(v) for t, v in d.items()})
            offs.append(pos)
            pos += len(s)
        return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    def _chat_logprobs(self, token_ids, logprobs, top_n: int) -> dict:
        content = []
        for tid, d in zip(token_ids, logprobs or []):
            s = self._token_str(tid)
            top = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({"token": s, "logprob": self._lp(d.get(tid)),
                            "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self._token_str(t), "logprob": self._lp(v),
                                              "bytes": list(self._token_str(t).encode())}
                                             for t, v in top]})
        return {"content": content}

    # ---------------------------------------------------------------- completions
    async def completions(self, req: CompletionRequest, raw: Request):
        self._check_model(req)
        self._check_common(req)
        if req.echo:
            raise BadRequest("echo is not supported", "echo")
        if req.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise BadRequest("best_of other than n is not supported", "best_of")
        p = req.prompt
        prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        if len(prompts) * req.n > self.options.max_n:
            raise BadRequest(f"a request runs at most {self.options.max_n} samples: "
                             f"{len(prompts)} prompts x n={req.n}", "n" if req.n > 1 else "prompt")
        if req.logprobs is not None:
            self._check_logprobs(req.logprobs, "logprobs")
        ids, sps, constraint = await self._offload(self._prepare_completion, req, prompts)
        base = f"cmpl-{uuid.uuid4().hex}"
        return await self._serve(
            raw, req, base, ids, sps, "prompt", "text_completion", self._completion_choice,
            self._completion_chunk_choice, constraint)

    def _prepare_completion(self, req: CompletionRequest, prompts: list):
        """(worker thread) ``(token ids per prompt, SamplingParams per prompt, constraint)``."""
        constraint = resolve(constraint_sources(req))
        ids = [self._tokenize(pr, "prompt") if isinstance(pr, str) else list(pr)
               for pr in prompts]
        # OpenAI's default max_tokens for completions is 16.
        sps = [self._sampling_params(req, req.max_tokens, len(i), req.logprobs, 16, "prompt",
                                     "max_tokens", constraint) for i in ids]
        self._compile(constraint)
        return ids, sps, constraint

    def _completion_choice(self, idx, c, req) -> dict:
        return {"index": idx, "text": c.text,
                "logprobs": (self._completion_logprobs(c.token_ids, c.logprobs, 0)
                             if req.logprobs is not None else None),
                "finish_reason": finish_reason(c.finish_reason), "stop_reason": c.stop_reason}

    def _completion_chunk_choice(self, idx, c, req, first: bool, offset: int) -> dict:
        return {"index": idx, "text": c.delta_text,
                "logprobs": (self._completion_logprobs(c.delta_token_ids,
                                                       (c.logprobs or [])[-len(c.delta_token_ids):]
                                                       if c.delta_token_ids else [], offset)
                             if req.logprobs is not None else None),
                "finish_reason": finish_reason(c.finish_reason), "stop_reason": c.stop_reason}

    # ---------------------------------------------------------------- chat
    @staticmethod
    def _template_messages(req: ChatCompletionRequest) -> list[dict]:
        """The messages as the chat template gets them: text content ("" for none), plus
        ``name``, ``tool_calls`` and ``tool_call_id`` where the client sent them."""
        msgs = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(part.text for part in content)
            msg = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls is not None:
                msg["tool_calls"] = [tc.model_dump(exclude_none=True) for tc in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            msgs.append(msg)
        return msgs

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        self._check_model(req)
        self._check_common(req)
        top = None
        if req.logprobs:
            top = req.top_logprobs or 0
            self._check_logprobs(top, "logprobs" if req.top_logprobs is None else "top_logprobs")
        elif req.top_logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        ids, sp, constraint, plan = await self._offload(self._prepare_chat, req, top)
        base = f"chatcmpl-{uuid.uuid4().hex}"
        return await self._serve(raw, req, base, [ids], [sp], "messages", "chat.completion",
                                 functools.partial(self._chat_choice, plan=plan),
                                 functools.partial(self._chat_chunk_choice, plan=plan),
                                 constraint)

    def _prepare_chat(self, req: ChatCompletionRequest, top: int | None):
        """(worker thread) ``(prompt token ids, SamplingParams, constraint, tool plan)``."""
        plan = plan_tools(req)
        sources = constraint_sources(req)
        if plan.forced:
            sources.append(("tools", {"json": plan.schema}))
        constraint = resolve(sources)
        messages = self._template_messages(req)
        chars = sum(len(m["content"]) for m in messages)
        room = self.max_model_len - 1
        if chars > room * self.max_token_chars:
            raise BadRequest(f"messages: {chars} characters of content cannot fit in the {room} "
                             f"prompt tokens max_model_len={self.max_model_len} allows",
                             "messages")
        extra = {} if plan.template_tools is None else {"tools": plan.template_tools}
        try:
            prompt = self.tokenizer.apply_chat_template(messages, **extra)
        except Exception as e:  # noqa: BLE001 -- template errors are the request's fault
            raise BadRequest(f"messages: cannot apply the chat template: {e}", "messages") from e
        ids = self._tokenize(prompt, "messages")
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        sp = self._sampling_params(req, max_tokens, len(ids), top, None, "messages", field,
                                   constraint)
        self._compile(constraint)
        return ids, sp, constraint, plan

    @staticmethod
    def _tool_result(plan: ToolPlan, c) -> tuple[list | None, str | None]:
        """``(tool_calls, finish_reason)`` of a finished sample: the parsed calls of a forced
        tool call (None if the output is not one) and "tool_calls" for a call that ended
        normally ("length" stays)."""
        reason = finish_reason(c.finish_reason)
        calls = plan.parse(c.text) if plan.forced else None
        if calls is not None and reason == "stop":
            reason = "tool_calls"
        return calls, reason

    def _chat_choice(self, idx, c, req, plan: ToolPlan) -> dict:
        calls, reason = self._tool_result(plan, c)
        message = {"role": "assistant", "content": c.text} if calls is None else \
            {"role": "assistant", "content": None, "tool_calls": calls}
        return {"index": idx, "message": message,
                "logprobs": (self._chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                             if req.logprobs else None),
                "finish_reason": reason, "stop_reason": c.stop_reason}

    def _chat_chunk_choice(self, idx, c, req, first: bool, offset: int,
                           plan: ToolPlan) -> dict | None:
        lp = None
        if req.logprobs:
            n = len(c.delta_token_ids)
            lp = self._chat_logprobs(c.delta_token_ids, (c.logprobs or [])[-n:] if n else [],
                                     req.top_logprobs or 0)
        reason = finish_reason(c.finish_reason)
        if not plan.forced:
            delta = {"role": "assistant", "content": c.delta_text} if first else \
                ({"content": c.delta_text} if c.delta_text else {})
        else:
            # A forced tool call streams no content: its calls come in the last chunk, whole
            # (or, when the output is not a call, its whole text as content).
            delta = {"role": "assistant"} if first else {}
            if c.finish_reason is None:
                if not first and lp is None:
                    return None
            else:
                calls, reason = self._tool_result(plan, c)
                if calls is None:
                    delta["content"] = c.text
                else:
                    delta["tool_calls"] = [dict(call, index=j) for j, call in enumerate(calls)]
        return {"index": idx, "delta": delta, "logprobs": lp,
                "finish_reason": reason, "stop_reason": c.stop_reason}

    # ---------------------------------------------------------------- shared serving
    async def _serve(self, raw: Request, req, base: str, prompts: list, sps: list,
                     prompt_field: str, obj: str, choice_fn, chunk_fn,
                     constraint: Constraint | None = None):
        n = req.n
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        streams = []
        try:
            for rid, pr, sp in zip(ids, prompts, sps):
                streams.append(await self._submit(rid, pr, sp, prompt_field, constraint))
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

    def _prompt_logprobs(self, plp) -> list | None:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{"<id>":
        {"logprob", "rank": null, "decoded_token"}}``."""
        if plp is None:
            return None
        return [None if d is None else
                {str(t): {"logprob": self._lp(v), "rank": None,
                          "decoded_token": self._token_str(t)} for t, v in d.items()}
                for d in plp]

    async def _collect(self, ids, streams, head, req, n, choice_fn) -> dict:
        usage = Usage()
        final: dict[int, Any] = {}
        prompt_lp: dict[int, Any] = {}
        seen = set()
        try:
            async for i, out in _merge(streams):
                if out.prompt_logprobs is not None:
                    prompt_lp[i] = out.prompt_logprobs
                if i not in seen:
                    seen.add(i)
                    usage.prompt += len(out.prompt_token_ids)
                    self.metrics.prompt_tokens.inc(len(out.prompt_token_ids))
                for c in out.outputs:
                    _check_not_aborted(c, ids[i])
                    if c.finish_reason is not None or out.finished:
                        final[i * n + c.index] = c
                if out.finished:
                    usage.add_metrics(out.metrics)
        finally:
            for rid in ids:
                await self.engine.abort(rid)     # no-op for finished requests
        choices = []
        for idx in sorted(final):
            c = final[idx]
            usage.completion += len(c.token_ids)
            choices.append(choice_fn(idx, c, req))
            if req.prompt_logprobs is not None and head["object"] == "text_completion":
                choices[-1]["prompt_logprobs"] = self._prompt_logprobs(prompt_lp.get(idx // n))
        body = dict(head, choices=choices, usage=usage.as_dict())
        if req.prompt_logprobs is not None and head["object"] != "text_completion":
            body["prompt_logprobs"] = self._prompt_logprobs(prompt_lp.get(0))   # vLLM: top level
        return body

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
        usage = Usage()
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
                    _check_not_aborted(c, ids[i])
                    idx = i * n + c.index
                    first = idx not in started
                    if idx in done or not (first or c.delta_text or c.delta_token_ids
                                           or c.finish_reason):
                        continue    # finished samples of n > 1 reappear until all finish
                    if c.finish_reason is not None:
                        done.add(idx)
                    started.add(idx)
                    choice = chunk_fn(idx, c, req, first, offsets.get(idx, 0))
                    if choice is not None and first and req.prompt_logprobs is not None:
                        choice["prompt_logprobs"] = self._prompt_logprobs(out.prompt_logprobs)
                    if choice is not None:      # None: nothing to send yet (a tool call)
                        choices.append(choice)
                    # text_offset counts the tokens' own strings (what the non-streamed
                    # response's offsets count), not the delta text a stop string holds back
                    offsets[idx] = offsets.get(idx, 0) + sum(
                        len(self._token_str(t)) for t in c.delta_token_ids)
                    if c.finish_reason is not None:
                        usage.completion += len(c.token_ids)
                if out.finished:
                    usage.add_metrics(out.metrics)
                if choices:
                    yield sse(dict(head, object=head["object"] + (
                        ".chunk" if head["object"] == "chat.completion" else ""), choices=choices))
            if include_usage:
                yield sse(dict(head, object=head["object"] + (
                    ".chunk" if head["object"] == "chat.completion" else ""), choices=[],
                    usage=usage.as_dict()))
            finished_ok = True
        except asyncio.CancelledError:   # client went away (Starlette cancels the response task)
            raise
        except GenerationAborted as e:   # logged where raised; the error goes to this stream
            self.metrics.request_errors.labels(status="500").inc()
            yield sse(error_body(e.message, e.type, None, e.code))
        except Exception:  # noqa: BLE001 -- the error goes to this stream only
            log.exception("stream %s failed", head["id"])
            self.metrics.request_errors.labels(status="500").inc()
            yield sse(error_body("generation failed in the engine (the server log has the "
                                 "details)", "internal_error", None))
        finally:
            for rid in ids:
                await self.engine.abort(rid)     # no-op for finished requests
            if not finished_ok:
                log.info("stream %s ended early: aborted %s", head["id"], ids)
        yield "data: [DONE]\n\n"
