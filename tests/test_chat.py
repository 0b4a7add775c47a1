"""``jmtp chat``: the REPL's history and chat-template handling, prefix-cache reuse across turns,
the idle-time warm-up (no compile in a later turn), Ctrl-C, commands, end of input; on a tiny
random model with SmolLM2's tokenizer and chat template."""
from __future__ import annotations

import io
import os
import signal
import sys

import jax
import pytest

from jmtp.chat import ChatSession, run_repl
from jmtp.runtime.config import SpeculativeConfig
from jmtp.runtime.host.llm import LLM, SamplingParams
from tests.runtime.conftest import tiny_model

# one worker builds the shared engines once; the tests are about which buckets a turn and the
# idle-time warm-up compile, so each step runs in a compiled bucket that holds it (fewest)
pytestmark = [pytest.mark.xdist_group("chat"), pytest.mark.compile_fewest]

# jmtp chat's engine in small: one slot, MTP speculation, prefix caching, scanned layers
ENGINE = dict(max_num_seqs=1, max_model_len=256, block_size=8, max_num_batched_tokens=64,
              enable_prefix_caching=True, layer_loop="scan",
              speculative_config=SpeculativeConfig("mtp", 2, 2))
SP = SamplingParams(max_tokens=8)
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


def _llm(tok) -> LLM:
    cfg, params = tiny_model(0, vocab_size=tok.vocab_size)
    return LLM(model_config=cfg, params=params, tokenizer=tok, **ENGINE)


@pytest.fixture(scope="module")
def llm(smollm2_tokenizer):
    return _llm(smollm2_tokenizer)


class _BackendCompiles:
    """Counts XLA backend compiles (cache misses of JAX's compilation) while active."""

    def __init__(self):
        self.count = 0

    def _listen(self, event, duration, **kw):
        if event == BACKEND_COMPILE:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)


def test_two_turns_reuse_the_cache_equal_fresh_chat_and_compile_nothing_after_warmup(
        llm, smollm2_tokenizer):
    session = ChatSession(llm, SP, system="Be brief.")
    eng = llm.llm_engine
    streamed: list[str] = []
    st1 = session.turn("What is 2+2?", streamed.append)
    reply1 = session.messages[-1]["content"]
    assert "".join(streamed) == reply1 and st1.num_tokens > 0 and not st1.interrupted
    assert st1.time_to_first_token is not None and st1.compiled     # lazy: turn 1 compiles
    # turn 1's prefill ran in a bucket of at most 32 rows: turn 2's longer message (more than
    # 32 new rows) needs a bigger one, which a lazy step would compile (32 does not hold it)
    assert max(b.num_tokens for b in eng.compiled_buckets) <= 32
    # the warm-up's first compile can hold the next turn's prefill and is not padded away
    rows = session.next_turn_rows()
    first = session.pending_buckets(rows)[0]
    assert rows > ENGINE["block_size"] // 2 and first.num_tokens >= rows
    assert eng.bucket_to_run(first) == first
    # idle time: the warm-up compiles every remaining step bucket
    assert session.start_warmup(delay=0)
    session.finish_warmup(cancel=False)
    assert session.warmup_seconds and not session.pending_buckets()
    assert session.warmup_error is None and not session.start_warmup()
    firsts, hits0 = dict(eng.first_call_seconds), eng.get_stats()["prefix_cache_hit_tokens"]
    streamed.clear()
    with _BackendCompiles() as compiles:
        st2 = session.turn("And 3+3? " + "Please explain every step in detail. " * 4,
                           streamed.append)
    reply2 = session.messages[-1]["content"]
    assert "".join(streamed) == reply2
    # (c) nothing compiled in turn 2: no new step bucket, no XLA compile at all
    assert eng.first_call_seconds == firsts and not st2.compiled and compiles.count == 0
    # (a) turn 2's prompt read turn 1's cached blocks
    assert st2.cached_tokens == eng.get_stats()["prefix_cache_hit_tokens"] - hits0
    assert st2.cached_tokens >= ENGINE["block_size"]
    assert 32 < st2.prompt_tokens - st2.cached_tokens <= ENGINE["max_num_batched_tokens"]
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user",
                                                     "assistant"]
    # (b) each reply is what LLM.chat on a fresh engine gives for the same history (greedy)
    for upto, reply in ((3, reply1), (5, reply2)):
        fresh = _llm(smollm2_tokenizer)
        [out] = fresh.chat(session.messages[:upto - 1], SP, use_tqdm=False)
        assert out.text == reply
        assert fresh.llm_engine.get_stats()["prefix_cache_hit_tokens"] == 0
    line = st2.line()
    assert line.startswith("[ttft ") and f"prefix cache hit {st2.cached_tokens} of" in line


def test_ctrl_c_aborts_the_reply_and_keeps_the_session(llm):
    session = ChatSession(llm, SamplingParams(max_tokens=24, ignore_eos=True))
    eng = llm.llm_engine
    chunks: list[str] = []

    def write(text):             # Ctrl-C as soon as the reply starts
        chunks.append(text)
        if len(chunks) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    handler = signal.getsignal(signal.SIGINT)
    st = session.turn("Tell me a story.", write)
    assert st.interrupted and st.finish_reason is None and 0 < st.num_tokens < 24
    assert "interrupted" in st.line()
    assert signal.getsignal(signal.SIGINT) is handler       # the turn's handler is gone
    assert session.messages == [] and not eng.has_unfinished_requests()
    st = session.turn("Hi", lambda s: None)                  # the session goes on
    assert not st.interrupted and st.num_tokens == 24 and len(session.messages) == 2


def test_repl_commands_reset_and_end_of_input(llm):
    session = ChatSession(llm, SP)
    out, err = io.StringIO(), io.StringIO()
    rc = run_repl(session, io.StringIO("Hi\n\n/stats\n/reset\n/bogus\nHi\n"), out, err)
    assert rc == 0 and not session.warming_up
    lines = out.getvalue().splitlines()
    stats = [ln for ln in lines if ": " in ln and ln.split(": ")[0].isidentifier()]
    assert any(ln.startswith("prefix_cache_hit_tokens: ") for ln in stats)
    assert any(ln.startswith("turns: 1") for ln in stats)
    replies = [ln for ln in lines if ln not in stats]
    # /reset cleared the history: the same first message gets the same greedy reply
    assert len(replies) == 2 and replies[0] == replies[1]
    assert session.messages == [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": session.messages[1]["content"]}]
    e = err.getvalue()
    assert e.count("[ttft ") == 2 and "[conversation reset]" in e and "unknown command" in e
    assert len(session.turns) == 2 and session.turns[1].cached_tokens > 0
    # input that ends straight away: a clean exit
    assert run_repl(session, io.StringIO(""), io.StringIO(), io.StringIO()) == 0


def test_chat_subcommand_defaults_and_pipe(llm, monkeypatch, capsys):
    from jmtp import cli

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))   # restored afterwards

    p = cli.build_parser()
    a = p.parse_args(["chat"])
    assert (a.enable_prefix_caching, a.layer_loop, a.max_tokens, a.temperature, a.system,
            a.max_num_seqs) == (True, "scan", 256, 0.0, None, None)
    assert p.parse_args(["chat", "--layer-loop", "unrolled"]).layer_loop == "unrolled"
    seen = {}

    def fake_build(args):
        seen.update(vars(args))
        return llm

    monkeypatch.setattr(cli, "build_llm", fake_build)
    monkeypatch.delenv("JMTP_COMPILE", raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n/exit\nnot read\n"))
    assert cli.main(["chat", "--max-tokens", "4", "--system", "Be brief."]) == 0
    assert (seen["enable_prefix_caching"], seen["max_num_seqs"], seen["compile"],
            seen["layer_loop"]) == (True, 1, "lazy", "scan")
    out, err = capsys.readouterr()
    assert "=== start-up: " in err and err.count("[ttft ") == 1 and out.strip()


def test_chat_keeps_prefix_caching_on_for_a_hybrid_model(monkeypatch, capsys):
    """``jmtp chat`` keeps turns warm with prefix caching, hybrid linear-attention models too
    (their block-boundary states are cached beside the KV blocks, ``docs/hybrid.md``)."""
    from pathlib import Path
    from jmtp import cli

    class Stop(BaseException):
        pass

    seen = {}

    def fake_build(args):
        seen.update(vars(args))
        raise Stop

    monkeypatch.setattr(cli, "build_llm", fake_build)
    gguf = Path(__file__).parent / "model" / "fixtures" / "gguf_moe" / "qwen35" / "model.gguf"
    with pytest.raises(Stop):
        cli.main(["chat", "--model", str(gguf)])
    assert seen["enable_prefix_caching"] is True
    assert "prefix caching off" not in capsys.readouterr().out
