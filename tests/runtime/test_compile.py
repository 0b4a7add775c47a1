"""Compilation out of the hot path (jmtp/runtime/process/compile.py): ahead-of-time bucket compiles and the
persistent compilation cache. Tiny random model, one or two token buckets."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import jax
import pytest

import jmtp
from jmtp.runtime.device.buckets import step_buckets
from jmtp.runtime.process import compile as jc

from tests.runtime.conftest import reference_greedy, tiny_model

pytestmark = pytest.mark.compile_lazy   # about buckets: each step in its own (conftest.py)

PROMPT = [3, 4, 5, 6, 7]


@pytest.fixture
def jax_cache_config():
    """Restore JAX's process-wide cache settings after a test changes them."""
    from jax.experimental.compilation_cache import compilation_cache as cc
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {n: getattr(jax.config, n) for n in names}
    yield
    for n, v in saved.items():
        jax.config.update(n, v)
    cc.reset_cache()


class _CompileLog(logging.Handler):
    """Collects JAX's "Compiling <name> ..." messages (emitted under ``jax.log_compiles()``)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling "):
            self.names.append(msg.split()[1])

    def __enter__(self):
        self._ctx = jax.log_compiles()
        self._ctx.__enter__()
        logging.getLogger("jax").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("jax").removeHandler(self)
        self._ctx.__exit__(*exc)


def _llm(compile_mode, spec=None, max_model_len=48):
    cfg, params = tiny_model()
    # max_num_seqs=1 and an 8-token budget (see step_buckets).
    return jmtp.LLM(model_config=cfg, params=params, max_num_seqs=1, max_model_len=max_model_len,
                    max_num_batched_tokens=8, speculative_config=spec, compile=compile_mode,
                    compilation_cache_dir=None)


@pytest.mark.parametrize("spec", [None, jmtp.SpeculativeConfig("mtp", num_speculative_tokens=2,
                                                               num_model_steps=1)])
def test_eager_compile_then_generate_compiles_nothing(spec):
    with _CompileLog() as at_init:
        llm = _llm("eager", spec)
    buckets = step_buckets(llm.llm_engine.engine_config)
    # Hand-worked: plain (W=1): decode (1, A=1), prefill (8, 1); K=2 (W=3): decode T = 1, 2, 3,
    # prefill T = 3, 8.
    assert len(buckets) == (2 if spec is None else 4)
    assert at_init.names.count("jit(engine_step)") == len(buckets)
    assert set(llm.compile_seconds) == ({f"T={b.num_tokens},A={b.num_slots}" for b in buckets}
                                        | {"insert", "release"})
    # A 7-token prompt prefills in the 8-token bucket, then decodes in the smallest one.
    with _CompileLog() as at_gen:
        out = llm.generate([PROMPT + [8, 9]], jmtp.SamplingParams(max_tokens=6))[0]
    assert at_gen.names == [], f"generate compiled {at_gen.names}"
    cfg, params = tiny_model()
    assert out.token_ids == reference_greedy(cfg, params, PROMPT + [8, 9], 6)


def test_lazy_compiles_on_first_use():
    with _CompileLog() as at_init:   # an engine no other test builds (JAX caches in memory too)
        llm = _llm("lazy", max_model_len=40)
    assert "jit(engine_step)" not in at_init.names
    assert llm.compile_seconds == {}
    with _CompileLog() as at_gen:
        llm.generate([PROMPT], jmtp.SamplingParams(max_tokens=3))
    assert "jit(engine_step)" in at_gen.names      # the check above can fail


def test_compile_mode_from_env_and_bad_value(monkeypatch):
    monkeypatch.setenv("JMTP_COMPILE", "lazy")
    assert jc.resolve_compile_mode(None) == "lazy"
    monkeypatch.delenv("JMTP_COMPILE")
    assert jc.resolve_compile_mode(None) == "eager"
    with pytest.raises(ValueError, match="compile must be one of"):
        _llm("sometimes")


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.delenv("JMTP_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert jc.default_cache_dir() == str(tmp_path / "xdg" / "jmtp" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert jc.default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "jmtp", "xla")
    monkeypatch.setenv("JMTP_CACHE_DIR", str(tmp_path / "mine"))
    assert jc.default_cache_dir() == str(tmp_path / "mine")
    for off in ("off", "0", ""):
        monkeypatch.setenv("JMTP_CACHE_DIR", off)
        assert jc.default_cache_dir() is None


def test_cache_dir_option_env_and_user_setting(monkeypatch, tmp_path, jax_cache_config):
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("JMTP_CACHE_DIR", "off")
    assert jc.setup_compilation_cache("auto") is None
    assert jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv("JMTP_CACHE_DIR", str(tmp_path / "env"))
    assert jc.setup_compilation_cache("auto") == str(tmp_path / "env")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "env")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    # "auto" keeps a folder already set (the user's own); None leaves it; a path replaces it.
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "user"))
    assert jc.setup_compilation_cache("auto") == str(tmp_path / "user")
    assert jc.setup_compilation_cache(None) == str(tmp_path / "user")
    assert jc.setup_compilation_cache(False) == str(tmp_path / "user")
    with pytest.raises(ValueError, match="compilation_cache_dir"):
        jc.setup_compilation_cache(3)
    # An LLM with an explicit folder writes its executables there (an engine no other test
    # builds: one compiled earlier in this process would come from JAX's in-memory cache).
    cfg, params = tiny_model()
    llm = jmtp.LLM(model_config=cfg, params=params, max_num_seqs=1, max_model_len=44,
                   max_num_batched_tokens=8, compile="eager",
                   compilation_cache_dir=str(tmp_path / "explicit"))
    assert llm.llm_engine.compilation_cache_dir == str(tmp_path / "explicit")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "explicit")
    assert len(os.listdir(tmp_path / "explicit")) >= len(step_buckets(llm.llm_engine.engine_config))


_CHILD = textwrap.dedent("""
    import sys, jax, jmtp
    sys.path.insert(0, {root!r})
    from tests.runtime.conftest import tiny_model
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(1) if name == "/jax/compilation_cache/cache_hits" else None)
    cfg, params = tiny_model()
    jmtp.LLM(model_config=cfg, params=params, max_num_seqs=1, max_model_len=48,
             max_num_batched_tokens=8, compile="eager", compilation_cache_dir={cache!r})
    print("HITS", len(hits))
""")


def test_second_process_hits_the_persistent_cache(tmp_path):
    """Two fresh processes build the same engine: the second loads every step executable from
    the folder the first one wrote (JAX's cache-hit event counts them)."""
    code = _CHILD.format(root=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                         cache=str(tmp_path / "cache"))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JMTP_CACHE_DIR", None)
    hits = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        hits.append(int(r.stdout.split("HITS")[-1]))
    assert hits[0] == 0
    assert hits[1] >= 4                     # two step buckets + insert + release


def test_lazy_reuses_a_compiled_bucket_at_most_twice_the_work():
    """A lazy engine runs a step in an already compiled bucket holding at most twice its rows
    rather than compiling a new one; tokens stay the reference's. Plain decoding, one slot, a
    32-token budget: token buckets T = 1, 8, 16, 32 (hand-worked from EngineConfig.token_buckets)."""
    cfg, params = tiny_model()
    llm = jmtp.LLM(model_config=cfg, params=params, max_num_seqs=1, max_model_len=64,
                   max_num_batched_tokens=32, compile="lazy", compilation_cache_dir=None)
    first = llm.llm_engine.first_call_seconds
    sp = jmtp.SamplingParams(max_tokens=3, ignore_eos=True)
    prompts = {20: "T=32,A=1", 12: None, 5: "T=8,A=1"}   # 12 rows: T=16 -> T=32 reused
    for n, new in prompts.items():
        before = set(first)
        prompt = [(7 * i + n) % cfg.vocab_size for i in range(n)]
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert out.token_ids == reference_greedy(cfg, params, prompt, 3, stop_ids=[])
        added = set(first) - before
        assert added == ({new} if new else set()) | ({"T=1,A=1"} if n == 20 else set())
    assert "T=16,A=1" not in first
    st = llm.last_run_stats
    assert 0 < st["time_to_first_token"] <= st["seconds"]
    assert st["generated_tokens"] == 3 and st["decode_tokens_per_second"] > 0


def test_largest_compiles_one_step_program_and_runs_every_step_in_it():
    """``compile="largest"``: the first step compiles the largest bucket (the 32-token budget over
    both slots: T=32, A=2) and every step after it, prefill chunk or decode, one slot or two, runs
    in it; tokens stay the reference's. MTP K=2, three prompts on two slots (one waits)."""
    from jmtp.runtime.device.buckets import StepBucket
    cfg, params = tiny_model()
    llm = jmtp.LLM(model_config=cfg, params=params, max_num_seqs=2, max_model_len=64,
                   speculative_config=jmtp.SpeculativeConfig("mtp", 2),
                   max_num_batched_tokens=32, compile="largest", compilation_cache_dir=None)
    run = llm.llm_engine.runner
    assert run.largest_bucket == StepBucket(32, 2) == step_buckets(run.shard_config)[-1]
    assert llm.llm_engine.first_call_seconds == {}       # nothing compiled before the first step
    seen, real = [], run.jitted_step
    run.jitted_step = lambda *a: (seen.append(a[0].bucket), real(*a))[1]
    prompts = [[(7 * i + n) % cfg.vocab_size for i in range(n)] for n in (20, 5, 12)]
    outs = llm.generate(prompts, jmtp.SamplingParams(max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(cfg, params, prompt, 6, stop_ids=[])
    assert len(seen) > 3 and set(seen) == {StepBucket(32, 2)}
    assert set(llm.llm_engine.first_call_seconds) == {"T=32,A=2"}


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_decode_rate_leaves_out_a_compile_dispatched_before_the_first_token(async_scheduling):
    """A fresh lazy engine: the decode bucket's first run (its compile) is dispatched before the
    first token is read when scheduling is asynchronous. The decode rate must leave that compile
    out and stay above 0 (``jmtp generate`` printed "decode 0.0 tok/s" for short answers: the
    compile was counted at the fetch, after the first token, and subtracted from a window that
    never held it)."""
    cfg, params = tiny_model()
    llm = jmtp.LLM(model_config=cfg, params=params, max_num_seqs=1, max_model_len=64,
                   max_num_batched_tokens=32, compile="lazy", compilation_cache_dir=None,
                   async_scheduling=async_scheduling)
    llm.generate([[5, 6, 7]], jmtp.SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    st = llm.last_run_stats
    assert st["generated_tokens"] == 4
    assert st["decode_tokens_per_second"] > 0
    # it is at least the plain rate over the whole time after the first token
    assert st["decode_tokens_per_second"] >= 3 / (st["seconds"] - st["time_to_first_token"])


def test_fast_cpu_compile_flag_only_before_a_backend_starts():
    """use_fast_cpu_compiles() adds the flag to XLA_FLAGS before the first backend starts (on the
    jaxlib it was measured on) and changes nothing once one runs."""
    code = textwrap.dedent("""
        import os, importlib.metadata
        from jmtp.runtime.process import compile as jc
        first = jc.use_fast_cpu_compiles()
        import jax
        jax.devices()
        print(first, jc.use_fast_cpu_compiles(), importlib.metadata.version("jaxlib"),
              jc.FAST_CPU_COMPILE_FLAG in os.environ.get("XLA_FLAGS", ""))
    """)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    first, second, version, flag_set = r.stdout.split()
    expected = version.startswith("0.10.")
    assert (first, second, flag_set) == (str(expected), "False", str(expected))


def test_eager_engine_serves_mixed_traffic_without_compiling():
    """What ``jmtp serve`` relies on: after an eager start-up, a queue of requests with every kind
    of sampling (seeded sampling, top-k/p, min-p, penalties, logprobs, n=2, stop ids, bad ids) on
    a 2-slot MTP engine compiles nothing, whatever slot counts and windows its steps meet."""
    cfg, params = tiny_model()
    llm = jmtp.LLM(model_config=cfg, params=params, max_num_seqs=2, max_model_len=48,
                   max_num_batched_tokens=16, max_logprobs=2, compile="eager",
                   compilation_cache_dir=None,
                   speculative_config=jmtp.SpeculativeConfig("mtp", num_speculative_tokens=2))
    SP = jmtp.SamplingParams
    sps = [SP(max_tokens=5), SP(max_tokens=6, temperature=0.8, seed=1, top_k=5, top_p=0.9),
           SP(max_tokens=4, temperature=1.0, seed=2, min_p=0.1, presence_penalty=0.5,
              frequency_penalty=0.2, repetition_penalty=1.1),
           SP(max_tokens=5, logprobs=2), SP(max_tokens=3, n=2, temperature=0.7, seed=3),
           SP(max_tokens=7, stop_token_ids=(5,), bad_token_ids=(6,), min_tokens=2)]
    prompts = [[3 + i, 4, 5 + 2 * i, 6, 7][: 2 + i % 4] * (1 + i % 3) for i in range(len(sps))]
    with _CompileLog() as during:
        outs = llm.generate(prompts, sps, use_tqdm=False)
    assert during.names == [], f"traffic compiled {during.names}"
    assert [len(o.outputs) for o in outs] == [1, 1, 1, 1, 2, 1]
    assert all(o.finished for o in outs)
