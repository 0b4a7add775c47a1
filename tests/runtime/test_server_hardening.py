"""``jmtp serve`` under hostile input (issue 45), end to end: one live server subprocess on a tiny
random Llama checkpoint (tests/runtime/tiny_checkpoint.py: it loads in about a second; plain
decoding on 2 slots with a 16-token step budget has 5 step buckets, compiled on first use),
driven with httpx, raw HTTP/1.1 connections and the official ``openai`` client. The server's
options (size limits, strictness, OpenAPI) do not depend on the speculation method; the
speculative server is tested in test_server.py (a tiny model with SmolLM2's tokenizer) and on
SmolLM2 in test_server_e2e.py.

Each numbered item of the issue is a test. Where an item is about isolation, an innocent greedy
stream is in flight while the hostile requests arrive and must come out exactly as it does alone
(its reference is run alone first); ``/health`` must stay 200 and fast, and the connection that
carried the error must carry the next request (no ``Connection: close``, the same socket).
schemathesis then runs over the server's own OpenAPI document.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client.parser")

from tests.runtime.serve_process import metrics, running_server  # noqa: E402
from tests.runtime.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.xdist_group("server_tiny")   # one worker: one server for the module

MAX_MODEL_LEN, MAX_N, MAX_LOGPROBS = 96, 4, 2
SERVER_ARGS = ["--no-spec", "--max-num-seqs", "2", "--max-model-len", str(MAX_MODEL_LEN),
               "--max-num-batched-tokens", "16", "--layer-loop", "scan", "--compile", "lazy",
               "--max-n", str(MAX_N), "--max-logprobs", str(MAX_LOGPROBS)]
INNOCENT = {"prompt": "An innocent bystander walks by", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server(["--model", str(d)] + SERVER_ARGS, log) as base:
        yield base


@pytest.fixture(scope="module")
def innocent_text(server) -> str:
    """The innocent stream's text when it runs alone (this also compiles the step buckets the
    tests use)."""
    with httpx.Client(base_url=server, timeout=300) as c:
        r = c.post("/v1/completions", json=INNOCENT)
        assert r.status_code == 200, r.text
        assert c.post("/v1/completions", json=dict(INNOCENT, n=2)).status_code == 200
        return r.json()["choices"][0]["text"]


def stream_text(lines) -> str:
    text = ""
    for line in lines:
        if line.startswith("data: {"):
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            text += "".join(c["text"] for c in obj["choices"])
    return text


@contextlib.contextmanager
def innocent_in_flight(base: str):
    """An innocent greedy stream that has produced its first chunk; on exit its whole text is in
    ``box["text"]``."""
    box: dict = {}
    with httpx.Client(base_url=base, timeout=300) as c:
        with c.stream("POST", "/v1/completions", json=dict(INNOCENT, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            head = []
            for line in lines:
                head.append(line)
                if line.startswith("data: {"):
                    break
            yield box
            box["text"] = stream_text(head) + stream_text(lines)


class Conn:
    """One HTTP/1.1 keep-alive connection (http.client): :meth:`post` returns ``(status, json,
    headers)`` and asserts the server kept the connection (no ``Connection: close``, same
    socket)."""

    def __init__(self, base: str):
        host, port = base.split("//")[1].split(":")
        self.c = http.client.HTTPConnection(host, int(port), timeout=300)
        self.sock = None

    def post(self, path: str, body, *, raw: bytes | None = None, keep: bool = True):
        data = raw if raw is not None else json.dumps(body).encode()
        self.c.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = self.c.getresponse()
        payload = r.read()
        if keep:
            assert (r.getheader("connection") or "").lower() != "close"
            assert self.sock is None or self.c.sock is self.sock, "the connection was replaced"
            self.sock = self.c.sock
        return r.status, json.loads(payload), r.headers

    def close(self):
        self.c.close()


@pytest.fixture
def conn(server):
    c = Conn(server)
    yield c
    c.close()


def health_ms(base: str) -> tuple[int, float]:
    t = time.perf_counter()
    r = httpx.get(base + "/health", timeout=30)
    return r.status_code, (time.perf_counter() - t) * 1e3


def assert_error(status_body, status: int, param, *fragments):
    status_got, body, _ = status_body
    assert status_got == status, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param, err
    assert err["type"] == ("invalid_request_error" if status < 500 else err["type"])
    for f in fragments:
        assert f in err["message"], err
    # No engine-internal request id or Python-API hint in an HTTP error.
    for leak in ("cmpl-", "chatcmpl-", "request '", "LLM(", "SamplingParams."):
        assert leak not in err["message"], err
    return err


def ok_request(conn: Conn):
    """A small valid request on ``conn``: the connection still serves."""
    status, body, _ = conn.post("/v1/completions", {"prompt": "ok", "max_tokens": 2,
                                                    "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------- 1: huge max_tokens
def test_1_huge_max_tokens_is_400_and_harms_no_one(server, conn, innocent_text):
    chat = [{"role": "user", "content": "hi"}]
    with innocent_in_flight(server) as box:
        assert_error(conn.post("/v1/completions", {"prompt": "hi", "max_tokens": 2**31}), 400,
                     "max_tokens")
        assert_error(conn.post("/v1/chat/completions", {"messages": chat,
                                                        "max_completion_tokens": 2**40}),
                     400, "max_completion_tokens")
        assert_error(conn.post("/v1/completions", {"prompt": "hi", "min_tokens": 2**31}), 400,
                     "min_tokens")
        # Within the static range but past the context the prompt leaves (2 prompt tokens).
        assert_error(conn.post("/v1/completions", {"prompt": "hi", "max_tokens": 95}), 400,
                     "max_tokens", "leaves of max_model_len=96")
        assert health_ms(server)[0] == 200
        ok_request(conn)
    assert box["text"] == innocent_text
    # The largest budget the context allows runs to the end of the context.
    status, body, _ = conn.post("/v1/completions", {"prompt": "hi", "max_tokens": 94,
                                                    "ignore_eos": True, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 94


# ---------------------------------------------------------------- 2: unbounded n
def test_2_n_is_bounded_and_stalls_nothing(server, conn, innocent_text):
    with innocent_in_flight(server) as box:
        assert_error(conn.post("/v1/completions", {"prompt": "hi", "n": 10**6}), 400, "n")
        assert_error(conn.post("/v1/completions", {"prompt": "hi", "n": MAX_N + 1}), 400, "n")
        assert_error(conn.post("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2}), 400,
                     "n", f"at most {MAX_N} samples")
        code, ms = health_ms(server)
        assert code == 200
        ok_request(conn)
    assert box["text"] == innocent_text
    m = metrics(server)
    assert m[("jmtp_num_requests_waiting", ())] == 0        # nothing was queued
    status, body, _ = conn.post("/v1/completions", {"prompt": "hi", "n": MAX_N, "max_tokens": 2})
    assert status == 200 and sorted(c["index"] for c in body["choices"]) == list(range(MAX_N))


# ---------------------------------------------------------------- 3: body size, tokenizing
def _poll_health(base: str, stop: threading.Event, out: list):
    with httpx.Client(base_url=base, timeout=30) as c:
        while not stop.is_set():
            t = time.perf_counter()
            r = c.get("/health")
            out.append(((time.perf_counter() - t) * 1e3, r.status_code))
            time.sleep(0.005)


def _send_raw(base: str, head: bytes, body: bytes) -> bytes:
    """Send one request on a raw socket (the body in 64 KiB pieces; the server may refuse it
    and close before it is all sent) and return what the server answered."""
    host, port = base.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(head)
        with contextlib.suppress(OSError):       # refused early: broken pipe / reset
            for i in range(0, len(body), 1 << 16):
                s.sendall(body[i:i + (1 << 16)])
        answer = b""
        with contextlib.suppress(OSError):
            while True:
                data = s.recv(1 << 16)
                if not data:
                    break
                answer += data
    return answer


def test_3_big_bodies_are_refused_without_stalling(server, innocent_text):
    """A 20 MB body is refused with 413 before it is read (from its Content-Length; chunked, once
    it passes the limit) while /health keeps answering; a 4 MB prompt (under the 8 MiB body
    limit) is refused by the length bound before tokenizing."""
    lat: list = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll_health, args=(server, stop, lat))
    with innocent_in_flight(server) as box:
        poller.start()
        time.sleep(0.2)
        before = len(lat)
        body = b'{"prompt": "' + b"a" * (20 * 2**20) + b'"}'
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body))
        answer = _send_raw(server, head, body)
        # Without Content-Length (chunked): read until it passes the limit, then refused.
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + (1 << 16)]), body[i:i + (1 << 16)])
                           for i in range(0, len(body), 1 << 16)) + b"0\r\n\r\n"
        answer_chunked = _send_raw(server, head.replace(
            b"Content-Length: %d" % len(body), b"Transfer-Encoding: chunked"), chunked)
        t_big = time.perf_counter()
        big_prompt = httpx.post(server + "/v1/completions", timeout=120,
                                json={"prompt": "a" * (4 * 10**6), "max_tokens": 2})
        t_big = time.perf_counter() - t_big
        time.sleep(0.2)
        stop.set()
        poller.join()
    assert box["text"] == innocent_text
    for got in (answer, answer_chunked):
        status_line, _, rest = got.partition(b"\r\n")
        assert b" 413 " in status_line, got[:300]
        assert b"connection: close" in rest.lower()
        err = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
        assert "larger than this server's limit" in err["message"] and err["param"] is None
    assert big_prompt.status_code == 400 and big_prompt.json()["error"]["param"] == "prompt"
    assert "cannot fit" in big_prompt.json()["error"]["message"]
    during = [ms for ms, code in lat[before:]]
    assert all(code == 200 for _, code in lat) and len(during) >= 5
    # The issue's bound is 100 ms per answer (measured here on a quiet machine: ~2 ms median,
    # ~10 ms max). Other processes on a shared CI machine can delay any single answer, so the
    # test holds the median to it and every answer to 1 s (before the fix: tens of seconds).
    print(f"/health during the 20 MB refusals and the 4 MB prompt: {len(during)} answers, median "
          f"{statistics.median(during):.1f} ms, max {max(during):.1f} ms; 4 MB prompt answered "
          f"in {t_big * 1e3:.0f} ms")
    assert statistics.median(during) < 100 and max(during) < 1000


# ---------------------------------------------------------------- 4: lone surrogates
def test_4_lone_surrogates_are_400(server, conn, innocent_text):
    with innocent_in_flight(server) as box:
        assert_error(conn.post("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}), 400,
                     "prompt", "surrogate")
        assert_error(conn.post("/v1/chat/completions", {"messages": [
            {"role": "user", "content": [{"type": "text", "text": "x\udfffy"}]}]}), 400,
            "messages", "messages[0].content[0].text")
        assert_error(conn.post("/v1/completions", {"prompt": "hi", "stop": ["\udc00"]}), 400,
                     "stop")
        ok_request(conn)
        assert health_ms(server)[0] == 200
    assert box["text"] == innocent_text


# ---------------------------------------------------------------- 5: deep JSON schemas
def nested_schema(levels: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(levels):
        s = {"type": "object", "properties": {"a": s}}
    return s


def test_5_deep_schemas_are_400(server, conn, innocent_text):
    deep = nested_schema(33)         # 67 levels of JSON nesting: past the 64 a schema may have
    with innocent_in_flight(server) as box:
        assert_error(conn.post("/v1/completions", {"prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"name": "d", "schema": deep}}}), 400,
            "response_format", "nested more than 64 levels")
        tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
        assert_error(conn.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "tools": tools,
            "tool_choice": "required"}), 400, "tools", "nested more than 64 levels")
        # As JSON text, nested far past Python's recursion limit.
        text = '{"properties": {"a": ' * 3000 + "{}" + "}}" * 3000
        assert_error(conn.post("/v1/completions", {"prompt": "x", "guided_json": text}), 400,
                     "guided_json", "nested more than 64 levels")
        # The body itself nested 100 objects deep.
        assert_error(conn.post("/v1/completions", {"prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"name": "d", "schema": nested_schema(100)}}}),
            400, None, "nests JSON more than")
        ok_request(conn)
    assert box["text"] == innocent_text
    # A schema at the depth limit is served.
    ok = nested_schema(31)
    status, body, _ = conn.post("/v1/completions", {"prompt": "x", "max_tokens": 4,
                                                    "response_format": {
                                                        "type": "json_schema",
                                                        "json_schema": {"name": "d",
                                                                        "schema": ok}}})
    assert status == 200, body


# ---------------------------------------------------------------- 6: keep-alive after errors
def test_6_every_error_keeps_the_connection(server, conn):
    """400, 404 (route and model), 405 and engine-side 400s all come back on one keep-alive
    connection, each followed by a request that succeeds on the same socket."""
    cases = [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
        ("/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, 404),
        ("/v1/nothing", {}, 404),
        ("/v1/completions", {"prompt": "", "max_tokens": 2}, 400),               # the engine's
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(8))}, 400),
    ]
    for path, body, status in cases:
        got = conn.post(path, body)
        assert got[0] == status, got
        assert set(got[1]["error"]) == {"message", "type", "param", "code"}
        ok_request(conn)
    # The engine's own refusals carry no internal request id.
    assert_error(conn.post("/v1/completions", {"prompt": "", "max_tokens": 2}), 400, "prompt",
                 "prompt is empty")
    host, port = server.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("DELETE", "/v1/models")
    r = c.getresponse()
    assert r.status == 405 and json.loads(r.read())["error"]["message"]
    c.request("GET", "/v1/models")
    assert c.getresponse().status == 200
    c.close()


def test_6_a_500_keeps_the_connection(tmp_path):
    """An unexpected failure inside a request is a 500 in OpenAI's shape for that request only,
    answered on a connection that then serves the next request (in-process uvicorn with a
    scripted engine that raises)."""
    import uvicorn

    from jmtp.runtime.serve.server import ServerMetrics, build_app
    from tests.runtime.serve_process import free_port
    from tests.runtime.test_server_structured import ScriptedEngine, _tokenizer

    engine = ScriptedEngine()
    app = build_app(engine, _tokenizer(), model_name="m", max_model_len=4096,
                    metrics=ServerMetrics())
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        c = Conn(f"http://127.0.0.1:{port}")
        engine.error = RuntimeError("boom")
        status, body, _ = c.post("/v1/completions", {"prompt": "x"})
        assert status == 500 and body["error"]["type"] == "internal_error"
        assert "boom" not in body["error"]["message"]
        engine.error = None
        engine.reply = "fine"
        status, body, _ = c.post("/v1/completions", {"prompt": "x"})
        assert status == 200 and body["choices"][0]["text"] == "fine"
        c.close()
    finally:
        srv.should_exit = True
        th.join(30)


# ---------------------------------------------------------------- 7: body-parse failures
def test_7_body_parse_failures_answer_in_openai_shape(server, conn):
    before = metrics(server)
    cases = [
        (b'{"prompt": "\xff\xfe"}', None, "not UTF-8"),
        (b"", "prompt", "the request body is empty"),
        (b"   ", "prompt", "'prompt'"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, "nests JSON more than"),
        (b'{"prompt": "x", "temperature": NaN}', None, "not valid JSON"),
        (b'{"prompt": "x",', None, "not valid JSON"),
        (b'["prompt"]', None, "must be a JSON object"),
        (b"{}", "prompt", "prompt: Field required"),
    ]
    for raw, param, fragment in cases:
        assert_error(conn.post("/v1/completions", None, raw=raw), 400, param, fragment)
    assert_error(conn.post("/v1/chat/completions", None, raw=b""), 400, "messages", "'messages'")
    ok_request(conn)
    after = metrics(server)
    rejected = (after[("jmtp_requests_rejected_total", (("endpoint", "completions"),))]
                - before.get(("jmtp_requests_rejected_total", (("endpoint", "completions"),)), 0))
    received = (after[("jmtp_requests_total", (("endpoint", "completions"),))]
                - before[("jmtp_requests_total", (("endpoint", "completions"),))])
    assert rejected == len(cases) and received == len(cases) + 1


# ---------------------------------------------------------------- 8: strict fields
def test_8_unknown_fields_roles_and_coercions_are_refused(server, conn):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=model, prompt="hi", extra_body={"max_token": 1})
    assert ei.value.body["param"] == "max_token" and "max_tokens" in ei.value.body["message"]
    msgs = [{"role": "user", "content": "hi"}]
    for body, param in [
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "n": "2"}, "n"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
        ({"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
        ({"prompt": "hi", "stream": 1}, "stream"),
        ({"prompt": "hi", "structured_outputs": {"regex": "a", "typo": 1}}, "structured_outputs"),
    ]:
        assert_error(conn.post("/v1/completions", body), 400, param)
    assert_error(conn.post("/v1/chat/completions", {"messages": [
        {"role": "bogus", "content": "hi"}]}), 400, "messages", "messages[0].role")
    assert_error(conn.post("/v1/chat/completions", {"messages": msgs, "logprobs": "true"}), 400,
                 "logprobs")
    ok_request(conn)


def test_8_ignore_unknown_fields_option_lists_them():
    """With ``ignore_unknown_fields`` the unknown fields are dropped, the request runs, and the
    response lists them in ``Jmtp-Ignored-Fields``; wrong types are still refused."""
    from fastapi.testclient import TestClient

    from jmtp.runtime.serve.server import ServerMetrics, ServerOptions, build_app
    from tests.runtime.test_server_structured import ScriptedEngine, _tokenizer

    engine = ScriptedEngine()
    engine.reply = "ok"
    app = build_app(engine, _tokenizer(), model_name="m", max_model_len=256,
                    metrics=ServerMetrics(), options=ServerOptions(ignore_unknown_fields=True))
    with TestClient(app) as http_:
        r = http_.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi", "mood": "x"}], "max_token": 3,
            "max_tokens": 5})
        assert r.status_code == 200, r.text
        assert set(r.headers["jmtp-ignored-fields"].split(", ")) == {"max_token",
                                                                     "messages[0].mood"}
        assert engine.calls[-1][1].max_tokens == 5
        r = http_.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_token": 3, "n": "2"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# ---------------------------------------------------------------- 9: the OpenAPI document
def test_9_openapi_describes_the_server(server):
    doc = httpx.get(server + "/openapi.json").json()
    assert "422" not in json.dumps(doc["paths"])
    schemas = doc["components"]["schemas"]
    comp, chat = schemas["CompletionRequest"]["properties"], schemas["ChatCompletionRequest"]
    assert comp["n"]["maximum"] == MAX_N and comp["n"]["minimum"] == 1
    assert comp["max_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN - 1
    assert comp["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 2}
    assert comp["logprobs"]["anyOf"][0]["maximum"] == MAX_LOGPROBS
    assert schemas["CompletionRequest"]["additionalProperties"] is False
    assert schemas["ChatMessage"]["properties"]["role"]["enum"] == [
        "system", "developer", "user", "assistant", "tool"]
    assert "messages" in chat["required"]
    for path, model in [("/v1/completions", "CompletionResponse"),
                        ("/v1/chat/completions", "ChatCompletionResponse")]:
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
            model.replace("Response", "Request"))
        assert {"200", "400", "404", "413"} <= set(op["responses"])
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].endswith(model)
        assert "text/event-stream" in ok
        assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "ErrorResponse")
    assert doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]["$ref"].endswith("ModelList")
    health = doc["paths"]["/health"]["get"]["responses"]
    assert health["200"]["content"]["application/json"]["schema"]["$ref"].endswith("Health")
    assert "503" in health
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    r = httpx.get(server + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert httpx.get(server + "/health").headers["content-type"] == "application/json"


def test_9_schemathesis_finds_no_server_error_and_no_undocumented_response(server, tmp_path):
    """schemathesis (its CLI, bounded: a fixed seed, 25 examples per operation, coverage and
    fuzzing phases) over /openapi.json: every response is documented (status, content type,
    body schema, headers), schema-invalid requests are refused, and no 5xx."""
    pytest.importorskip("schemathesis")
    report = tmp_path / "st.ndjson"
    checks = ("not_a_server_error,status_code_conformance,content_type_conformance,"
              "response_headers_conformance,response_schema_conformance,"
              "negative_data_rejection,unsupported_method,missing_required_header")
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", server + "/openapi.json",
           "--checks", checks, "--max-examples", "25", "--seed", "45", "--workers", "1",
           "--request-timeout", "120", "--generation-database", "none", "--no-color",
           "--report", "ndjson", "--report-ndjson-path", str(report)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    seconds = time.perf_counter() - t0
    statuses: dict = {}
    for line in report.read_text().splitlines():
        for code in _status_codes(json.loads(line)):
            statuses[code] = statuses.get(code, 0) + 1
    print(f"schemathesis: {sum(statuses.values())} responses in {seconds:.0f} s: {statuses}")
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert sum(statuses.values()) >= 200 and statuses.get(200, 0) > 0
    assert not any(code >= 500 for code in statuses)


def _status_codes(event):
    """Every ``status_code`` in an ndjson event of the report (responses are nested)."""
    stack = [event]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            code = item.get("status_code")
            if isinstance(code, int):
                yield code
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


# ---------------------------------------------------------------- 10: /health, /metrics
def test_10_health_and_metrics_are_truthful(server):
    r = httpx.get(server + "/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["busy_seconds"] < 60 and body["requests_in_flight"] >= 0
    before = metrics(server)
    with httpx.Client(base_url=server, timeout=300) as c:
        futures = []
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            for i in range(6):      # 6 requests on 2 slots: some wait in the queue
                futures.append(pool.submit(c.post, "/v1/completions", json={
                    "prompt": f"queue {i}", "max_tokens": 24, "ignore_eos": True}))
            assert all(f.result().status_code == 200 for f in futures)
        assert c.post("/v1/completions", content=b"\xff").status_code == 400
    after = metrics(server)

    def delta(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("jmtp_request_queue_seconds_count") == 6
    assert delta("jmtp_request_queue_seconds_sum") > 0
    assert ("jmtp_num_preemptions_total", ()) in after
    assert delta("jmtp_requests_rejected_total", (("endpoint", "completions"),)) == 1
    assert delta("jmtp_requests_total", (("endpoint", "completions"),)) == 7


# ---------------------------------------------------------------- 11: seeded reproducibility
def test_11_seeded_requests_repeat_with_the_same_batch_history(server):
    """What the docs promise: a seeded sampled request gives the same text when it runs with the
    same batch history (here: alone, one after the other), also for each of n samples, streamed
    or not."""
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 1.0, "seed": 1234,
            "ignore_eos": True, "n": 2}
    with httpx.Client(base_url=server, timeout=300) as c:
        first = [ch["text"] for ch in c.post("/v1/completions", json=body).json()["choices"]]
        again = [ch["text"] for ch in c.post("/v1/completions", json=body).json()["choices"]]
        other = [ch["text"] for ch in c.post("/v1/completions", json=dict(body, seed=99)).json()[
            "choices"]]
    assert first == again
    assert first[0] != first[1] and other != first    # the seed and the sample index matter
