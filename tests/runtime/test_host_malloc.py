"""host_malloc: XLA:CPU scratch above glibc's 32 MiB mmap threshold stays mapped between
executions once ``tune_malloc`` applied the settings (counted in minor page faults, in fresh
processes since the settings are process-wide), ``import jmtp`` applies nothing, and the switches
behave as documented."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jmtp.runtime.process import host_malloc

PROBE = textwrap.dedent("""
    import resource
    import jmtp
    from jmtp.runtime.process.settings import tune_malloc
    tune_malloc()   # applies the malloc settings unless JMTP_MALLOC_TUNING=0
    import jax, jax.numpy as jnp
    # 40 MB of scratch: the barrier materialises x * 2 (a reversed read cannot fuse with it)
    f = jax.jit(lambda x: jnp.sum(jax.lax.optimization_barrier(x * 2.0)[::-1] * x))
    x = jnp.ones((10_000_000,), jnp.float32)
    temp = f.lower(x).compile().memory_analysis().temp_size_in_bytes
    for _ in range(60):     # the heap settles first (a few scratch-sized extensions)
        f(x).block_until_ready()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        f(x).block_until_ready()
    print(jmtp.runtime.process.host_malloc.applied, temp,
          (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20)
""")

glibc_only = pytest.mark.skipif(host_malloc._glibc_mallopt() is None, reason="needs glibc")


def run_python(code: str, tuning: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JMTP_MALLOC_TUNING=tuning, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def probe(tuning: str) -> tuple[bool, int, float]:
    out = run_python(PROBE, tuning).stdout.split()
    return out[-3] == "True", int(out[-2]), float(out[-1])


@glibc_only
def test_scratch_above_32_mib_is_not_remapped_every_step():
    applied, temp, faults_on = probe("1")
    assert applied
    assert temp > 32 * 2**20          # above glibc's largest mmap threshold: the case at stake
    applied, _, faults_off = probe("0")
    assert not applied
    # without the settings every call maps its 40 MB afresh: one fault per touched 4 KiB page;
    # with them the heap settles after a few extensions and the scratch is reused (one
    # extension costs ~pages faults, i.e. 0.05 * pages per call over the 20 timed calls: up to
    # three late extensions pass)
    pages = temp / 4096
    assert faults_off > 0.5 * pages, faults_off
    assert faults_on < 0.2 * pages, faults_on


def test_import_changes_nothing_and_a_mistyped_switch_warns():
    res = run_python("import jmtp, jmtp.runtime.process.host_malloc as h; print(h.applied)", "1")
    assert res.stdout.split()[-1] == "False"       # import jmtp is side-effect free
    res = run_python("from jmtp.runtime.process.settings import tune_malloc; print(tune_malloc())", "yes")
    assert res.stdout.split()[-1] == "False"
    assert "JMTP_MALLOC_TUNING='yes'" in res.stderr


def test_switches(monkeypatch):
    monkeypatch.setenv(host_malloc.ENV, "yes")
    with pytest.raises(ValueError, match="JMTP_MALLOC_TUNING"):
        host_malloc.configure()
    assert host_malloc.configure(force=False) is False
    monkeypatch.setenv(host_malloc.ENV, "0")
    assert host_malloc.configure() is False
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not host_malloc.runs_xla_on_cpu()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_malloc.runs_xla_on_cpu()
