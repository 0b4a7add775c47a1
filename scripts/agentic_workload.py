"""The agentic workload of ``scripts/bench_spec.py``: multi-turn sessions run as agents run them.

``scripts/data/agentic_sessions.json`` (written for jmtp, no outside data) holds sessions of two
kinds of agent, each session a list of turns:

* tool-calling assistants (one system prompt listing four tools): a user request, to which the
  model replies with a tool call as one JSON object; the tool's result (a fixed JSON text in
  the file, errors and retries included), to which it replies with an answer; the next request;
* code-edit loops (a coding-agent system prompt): a file and a task, to which the model replies
  with the whole updated file; then test results asking for a fix, then another small change,
  each answered with the whole file again.

Every reply is the model's own output, fed back into the conversation of the session's next
turn (its text, re-tokenized, as an OpenAI-style client sends it), so a turn's prompt holds the
earlier replies, and tool calls, answers and files recur across turns and across sessions.
:func:`run_sessions` drives an engine as an agent fleet would: every session's first turn is
queued at once; when a reply finishes, that session's next turn is queued behind the others (so
with one slot the sessions take turns, with eight they run side by side).

    import agentic_workload as aw
    outs = aw.run_sessions(llm, aw.load_sessions(), SamplingParams(max_tokens=96))
"""
from __future__ import annotations

import json
import pathlib

PATH = pathlib.Path(__file__).with_name("data") / "agentic_sessions.json"


def load_sessions(n: int = 0, path: str | pathlib.Path = PATH) -> list[dict]:
    """The sessions (``{"id", "system", "turns": [{"user": text} | {"tool": text}, ...]}``),
    the first ``n`` of each kind interleaved (0: all)."""
    sessions = json.loads(pathlib.Path(path).read_text())["sessions"]
    if n:
        kinds: dict[str, list] = {}
        for s in sessions:
            kinds.setdefault(s["id"].split("-")[0], []).append(s)
        sessions = [s for group in kinds.values() for s in group[:n]]
    return sessions


def _message(turn: dict) -> dict:
    (role, text), = turn.items()
    return {"role": role, "content": text}


def first_prompts(tokenizer, sessions) -> list[list[int]]:
    """Token ids of each session's first request (for warming an engine up)."""
    return [_encode(tokenizer, [{"role": "system", "content": s["system"]},
                                _message(s["turns"][0])]) for s in sessions]


def max_conversation_tokens(tokenizer, sessions, max_tokens: int) -> int:
    """An upper bound of any turn's prompt plus reply: a session's messages with every reply
    ``max_tokens`` tokens long (and 16 more: re-tokenizing a reply's text may merge differently
    than it was generated)."""
    worst = 0
    for s in sessions:
        msgs = [{"role": "system", "content": s["system"]}]
        for turn in s["turns"]:
            msgs += [_message(turn), {"role": "assistant", "content": ""}]
        worst = max(worst, len(_encode(tokenizer, msgs)) + len(s["turns"]) * (max_tokens + 16))
    return worst


def _encode(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def run_sessions(llm, sessions, sampling_params) -> dict[tuple[str, int], object]:
    """Run every session to its end on ``llm`` (a :class:`jmtp.LLM`) through its engine.

    Returns:
      ``{(session id, turn index): RequestOutput}`` of every request.

    Raises:
      InvalidRequestError: a turn's conversation does not fit the engine's ``max_model_len``.
    """
    eng, tok = llm.llm_engine, llm.tokenizer
    history = {s["id"]: [{"role": "system", "content": s["system"]}] for s in sessions}
    by_id = {s["id"]: s for s in sessions}
    outputs: dict[tuple[str, int], object] = {}

    def submit(sid: str, t: int) -> None:
        history[sid].append(_message(by_id[sid]["turns"][t]))
        eng.add_request(f"{sid}/{t}", _encode(tok, history[sid]), sampling_params)

    for s in sessions:
        submit(s["id"], 0)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if not out.finished:
                continue
            sid, t = out.request_id.rsplit("/", 1)
            t = int(t)
            outputs[(sid, t)] = out
            history[sid].append({"role": "assistant", "content": out.outputs[0].text})
            if t + 1 < len(by_id[sid]["turns"]):
                submit(sid, t + 1)
    return outputs
