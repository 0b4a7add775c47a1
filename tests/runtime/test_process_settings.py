"""jmtp/runtime/process/settings.py's ``freeze_heap``, and ``serve`` calling it once the engine is
built, before uvicorn starts. The freezing itself runs in a fresh interpreter: it is process-wide,
and the test processes freeze their own heaps between modules (tests/conftest.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import gc, json, weakref
from jmtp.runtime.process.settings import freeze_heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

gc.disable()                        # no automatic collection between the steps below
dead = weakref.ref(cycle())         # garbage before the freeze: collected by it, not frozen
old = cycle()                       # alive at the freeze: frozen
old_ref = weakref.ref(old)
frozen = freeze_heap()
dead_alive = dead() is not None
tracked = any(o is old for o in gc.get_objects())
del old
gc.collect()                        # a frozen cycle that died is not collected
old_alive = old_ref() is not None
new = cycle()                       # made after the freeze: collected as usual
new_ref = weakref.ref(new)
del new
gc.collect()
print(json.dumps(dict(frozen=frozen, count=gc.get_freeze_count(), tracked=tracked,
                      old_alive=old_alive, new_alive=new_ref() is not None,
                      dead_alive=dead_alive)))
"""


def _probe(switch: str | None) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("JMTP_GC_FREEZE", None)
    if switch is not None:
        env["JMTP_GC_FREEZE"] = switch
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_freeze_heap_takes_the_heap_out_of_full_collections():
    r = _probe(None)
    assert r["frozen"] > 1000 and r["count"] == r["frozen"]   # jmtp's imports at least
    assert not r["tracked"]             # no longer visited by the collector
    assert not r["dead_alive"]          # it collected first: garbage was not frozen
    assert r["old_alive"]               # the documented cost: a frozen cycle is not reclaimed
    assert not r["new_alive"]           # what is made later is collected as before


def test_freeze_heap_opt_out():
    r = _probe("0")
    assert r["frozen"] == 0 and r["count"] == 0 and r["tracked"] and not r["old_alive"]
    assert r["dead_alive"]              # nothing collected either (the collector is disabled)


def test_serve_freezes_after_the_engine_is_built_and_before_uvicorn(monkeypatch):
    """``serve`` (what ``jmtp serve`` runs) freezes the heap once, after building its app around
    the engine and before handing the app to uvicorn. (The other processes of ``jmtp launch --
    serve`` freeze before they follow process 0: ``jmtp/cli.py``.)"""
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from jmtp.runtime.process import settings
    from jmtp.runtime.serve.server import app as server_app
    from tests.engines import tiny_llm

    calls = []
    build_app = server_app.build_app
    monkeypatch.setattr(server_app, "build_app",
                        lambda *a, **kw: calls.append("build_app") or build_app(*a, **kw))
    monkeypatch.setattr(settings, "freeze_heap", lambda: calls.append("freeze") or 0)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append(("run", kw["port"])))
    llm = tiny_llm("plain")
    try:
        assert server_app.serve(llm, model_name="tiny", port=8123) == 0
    finally:
        llm.close()
    assert calls == ["build_app", "freeze", ("run", 8123)]
