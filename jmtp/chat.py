"""Interactive chat (``jmtp chat``): a read-eval-print loop over one warm :class:`~jmtp.LLM`.

The engine lives as long as the session, so a turn neither loads nor recompiles anything an
earlier turn did, and with prefix caching on (``jmtp chat`` forces it) each turn's prompt (the
whole conversation, rendered with the model's chat template) finds the earlier turns' KV blocks
cached and prefills only what is new: the user's message and the tail of the last reply.

With lazy compiles (``jmtp chat``'s default) the step buckets no turn has used yet compile in
idle time: after each turn a background thread compiles them one by one while the user reads
and types (:meth:`ChatSession.start_warmup`), first the ones that can hold the next turn's
prefill (the conversation's uncached tail plus a message) and a lazy step would not pad into an
already compiled bucket. The next turn stops it and waits for the compile in flight before it
touches the engine (the engine never steps while a bucket compiles): a turn that starts while
a compile runs waits for the rest of that one compile (the per-turn line says how long), and
once every bucket is compiled no turn compiles or waits. The thread starts compiling only
after a short idle delay, so scripted input (a pipe) that already has its next line does not
wait on a compile.

:class:`ChatSession` is the testable part (history, one turn, warm-up); :func:`run_repl` reads
lines and handles the commands ``/reset``, ``/stats``, ``/help`` and ``/exit`` (``/quit``,
end of input).
"""
from __future__ import annotations

import dataclasses
import itertools
import signal
import sys
import threading
import time
from typing import Any, Callable, TextIO

from jmtp.runtime.host.llm import FirstTokenClock
from jmtp.runtime.host.sampling_params import SamplingParams

COMMANDS = ("/reset", "/stats", "/help", "/exit", "/quit")
HELP = ("commands: /reset (forget the conversation), /stats (engine counters), /exit or /quit "
        "(or end of input) to leave; Ctrl-C stops a reply")


@dataclasses.dataclass
class TurnStats:
    """What one :meth:`ChatSession.turn` took.

    Attributes:
      time_to_first_token: seconds from the start of the turn (waiting for the warm-up
        included) to the reply's first token; None when it produced none.
      num_tokens: reply tokens.
      decode_tokens_per_second: tokens after the first over the time after it, lazy compiles
        met after it excluded (0.0 with fewer than two tokens).
      prompt_tokens: tokens of the rendered conversation.
      cached_tokens: prompt tokens found in the prefix cache (None without prefix caching).
      seconds: wall time of the whole turn.
      finish_reason: the reply's (``"stop"``, ``"length"``; None when interrupted).
      interrupted: Ctrl-C stopped the reply (the turn left the history unchanged).
      compiled: ``{bucket label: seconds}`` of step buckets compiled during the turn (lazily).
      warmup_wait: seconds the turn waited for the warm-up's compile in flight.
    """

    time_to_first_token: float | None
    num_tokens: int
    decode_tokens_per_second: float
    prompt_tokens: int
    cached_tokens: int | None
    seconds: float
    finish_reason: str | None
    interrupted: bool = False
    compiled: dict[str, float] = dataclasses.field(default_factory=dict)
    warmup_wait: float = 0.0

    def line(self) -> str:
        """The compact summary ``jmtp chat`` prints after a reply."""
        ttft = "n/a" if self.time_to_first_token is None else f"{self.time_to_first_token:.2f}s"
        parts = [f"ttft {ttft}", f"{self.num_tokens} tokens in {self.seconds:.2f}s",
                 f"{self.decode_tokens_per_second:.1f} tok/s"]
        if self.cached_tokens is not None:
            parts.append(f"prefix cache hit {self.cached_tokens} of {self.prompt_tokens} "
                         "prompt tokens")
        if self.compiled:
            parts.append(f"compiled or loaded {len(self.compiled)} step bucket"
                         f"{'s' if len(self.compiled) > 1 else ''} "
                         f"{sum(self.compiled.values()):.1f}s")
        if self.warmup_wait >= 0.05:
            parts.append(f"waited {self.warmup_wait:.1f}s for the warm-up")
        if self.interrupted:
            parts.append("interrupted, not kept")
        return "[" + ", ".join(parts) + "]"


class ChatSession:
    """A conversation with one :class:`~jmtp.LLM`: its message history, sampling parameters and
    the idle-time warm-up of its engine.

    Args:
      llm: the model (with a tokenizer that has a chat template). The session adds its own
        requests to ``llm.llm_engine``; nothing else may use that engine while a turn runs.
      sampling_params: for every reply (default: greedy, 256 tokens).
      system: a system prompt, the first message of every conversation (also after reset).
      warmup_delay: seconds the warm-up thread waits before it compiles anything; a turn that
        starts within them finds no compile in flight.

    Raises:
      ValueError: the model has no tokenizer or chat template.
    """

    def __init__(self, llm, sampling_params: SamplingParams | None = None, *,
                 system: str | None = None, warmup_delay: float = 0.5):
        tok = llm.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("jmtp chat needs a model whose tokenizer has a chat template")
        self.llm = llm
        self.engine = llm.llm_engine
        self.sampling_params = sampling_params or SamplingParams(max_tokens=256)
        self.system = system
        self.warmup_delay = warmup_delay
        self.messages: list[dict[str, str]] = []
        self.reset()
        self.turns: list[TurnStats] = []
        self._ids = itertools.count()
        self._warm: threading.Thread | None = None
        self._stop = threading.Event()
        #: ``{bucket label: seconds}`` of the step buckets the warm-up compiled.
        self.warmup_seconds: dict[str, float] = {}
        #: what stopped the warm-up early (e.g. a ``MapLimitError``), None if nothing did.
        self.warmup_error: BaseException | None = None

    # ------------------------------------------------------------------ history
    def reset(self) -> None:
        """Forget the conversation (the system prompt stays). Cached KV blocks stay in the
        engine's prefix cache until they are evicted."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    # ------------------------------------------------------------------ warm-up
    def pending_buckets(self, min_rows: int = 1) -> list:
        """The step buckets not compiled yet, the likeliest next use first: prefill buckets and
        full decode windows before partial decode windows (fewer drafts than K); then buckets
        that can hold the next turn's prefill (at least ``min_rows`` rows, see
        :meth:`next_turn_rows`) before smaller ones; then buckets a lazy step would compile (no
        compiled bucket holds their work, :meth:`LLMEngine.bucket_to_run`) before those it would pad
        into a compiled one; then by size (short follow-up messages are the common case)."""
        eng = self.engine
        w = eng.engine_config.window
        todo = eng.uncompiled_buckets()

        def key(b):
            full_window = b.num_tokens == b.num_slots * w      # every decode step of A slots
            return (b.num_tokens < b.num_slots * w, b.num_tokens < min_rows and not full_window,
                    eng.bucket_to_run(b) != b, b.num_tokens, b.num_slots)
        return sorted(todo, key=key)

    def next_turn_rows(self) -> int:
        """The prefill rows of the next turn if its message were empty: the tokens of the
        conversation rendered with an empty user message, less the blocks the prefix cache
        holds for them (the rows the last reply's tail and the template add)."""
        eng = self.engine
        text = self.llm.tokenizer.apply_chat_template(
            self.messages + [{"role": "user", "content": ""}], add_generation_prompt=True)
        ids = list(eng.tokenizer.encode(text))
        pcs = eng.prefix_caches
        return max(len(ids) - (pcs.cached_tokens(ids) if pcs is not None else 0), 1)

    def start_warmup(self, delay: float | None = None) -> bool:
        """Compile the remaining step buckets in a background thread, one at a time, until
        :meth:`finish_warmup` stops it or none is left. Returns whether a thread started (not
        when one runs already, when every bucket is compiled, or after a warm-up error)."""
        if self._warm is not None or self.warmup_error is not None:
            return False
        if not self.pending_buckets():
            return False
        self._stop.clear()
        delay = self.warmup_delay if delay is None else delay
        self._warm = threading.Thread(target=self._warmup, args=(delay, self.next_turn_rows()),
                                      daemon=True, name="jmtp-chat-warmup")
        self._warm.start()
        return True

    def _warmup(self, delay: float, min_rows: int) -> None:
        if delay > 0 and self._stop.wait(delay):
            return
        while not self._stop.is_set():
            todo = self.pending_buckets(min_rows)
            if not todo:
                return
            try:
                self.warmup_seconds.update(self.engine.compile_buckets([todo[0]]))
            except Exception as e:    # e.g. MapLimitError: leave the rest to lazy compiles
                self.warmup_error = e
                return

    @property
    def warming_up(self) -> bool:
        """A warm-up thread runs (or has finished and was not joined yet)."""
        return self._warm is not None

    def finish_warmup(self, cancel: bool = True) -> float:
        """Stop the warm-up after its compile in flight (``cancel``) or let it compile every
        remaining bucket, and wait for its thread; returns the seconds waited. Call before
        anything touches the engine."""
        t = self._warm
        if t is None:
            return 0.0
        if cancel:
            self._stop.set()
        t0 = time.perf_counter()
        t.join()
        self._warm = None
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ one turn
    def turn(self, user_text: str, write: Callable[[str], Any] = lambda s: None) -> TurnStats:
        """Send ``user_text``; stream the reply's new text through ``write`` as it is generated.

        The conversation (history plus this message) is rendered with the chat template and
        added to the engine as one request. A complete reply (finished by a stop token or
        ``max_tokens``) and the user's message join the history; a reply stopped by Ctrl-C
        (SIGINT while the turn runs in the main thread) is aborted and neither is kept, so the
        user can rephrase. Waits for the warm-up first (:meth:`finish_warmup`).

        Raises:
          ValueError: the conversation no longer fits in ``max_model_len`` (and the like, from
            ``add_request``); the history is unchanged.
          RuntimeError: from a step (e.g. ``MapLimitError``); the request is aborted and the
            history unchanged.
        """
        interrupted = False

        def on_sigint(signum, frame):
            nonlocal interrupted
            interrupted = True

        old_handler = None
        if threading.current_thread() is threading.main_thread():
            old_handler = signal.signal(signal.SIGINT, on_sigint)
        try:
            return self._turn(user_text, write, lambda: interrupted)
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)

    def _turn(self, user_text: str, write, interrupted: Callable[[], bool]) -> TurnStats:
        t0 = time.perf_counter()
        waited = self.finish_warmup()
        eng = self.engine
        messages = self.messages + [{"role": "user", "content": user_text}]
        prompt = self.llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        rid = f"chat-{next(self._ids)}"
        hits0 = eng.get_stats().get("prefix_cache_hit_tokens")
        firsts0 = dict(eng.first_call_seconds)
        if interrupted():          # Ctrl-C while waiting for the warm-up
            return TurnStats(None, 0, 0.0, 0, None, time.perf_counter() - t0, None, True,
                             warmup_wait=waited)
        eng.add_request(rid, prompt, self.sampling_params)
        clock = FirstTokenClock(eng, t0)
        last = None
        try:
            while eng.has_unfinished_requests() and not interrupted():
                for out in eng.step():
                    if out.request_id != rid:
                        continue
                    last = out
                    clock.saw(out)
                    if out.outputs[0].delta_text:
                        write(out.outputs[0].delta_text)
        finally:
            if eng.has_unfinished_requests():      # Ctrl-C, or a step raised
                eng.abort_request(rid)
        t_end = time.perf_counter()
        stopped = interrupted() and (last is None or not last.finished)
        compiled = {k: v for k, v in eng.first_call_seconds.items() if k not in firsts0}
        c = last.outputs[0] if last is not None else None
        n = len(c.token_ids) if c is not None else 0
        hits1 = eng.get_stats().get("prefix_cache_hit_tokens")
        stats = TurnStats(
            time_to_first_token=clock.ttft, num_tokens=n,
            decode_tokens_per_second=clock.decode_rate(n - 1, t_end),
            prompt_tokens=len(last.prompt_token_ids) if last is not None else 0,
            cached_tokens=None if hits0 is None else hits1 - hits0, seconds=t_end - t0,
            finish_reason=None if stopped else (c.finish_reason if c is not None else None),
            interrupted=stopped, compiled=compiled, warmup_wait=waited)
        if not stopped:
            self.messages = messages + [{"role": "assistant", "content": c.text if c else ""}]
        self.turns.append(stats)
        return stats

    def stats(self) -> dict:
        """The engine's counters (:meth:`LLMEngine.get_stats`) and the session's: turns, history
        messages, compiled and remaining step buckets, the warm-up's compiles."""
        eng = self.engine
        out = dict(eng.get_stats())
        out.update(turns=len(self.turns), history_messages=len(self.messages),
                   compiled_step_buckets=len(eng.compiled_buckets),
                   pending_step_buckets=len(self.pending_buckets()),
                   warmup_compiled_buckets=len(self.warmup_seconds),
                   warmup_compile_seconds=round(sum(self.warmup_seconds.values()), 3))
        if self.warmup_error is not None:
            out["warmup_error"] = str(self.warmup_error)
        return out


def _read_line(stdin: TextIO, stdout: TextIO, interactive: bool) -> str:
    """One line of input without its newline; raises EOFError at end of input."""
    if interactive and stdin is sys.stdin and stdout is sys.stdout:
        return input("> ")       # line editing (readline), the prompt on the terminal
    line = stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\r\n")


def run_repl(session: ChatSession, stdin: TextIO | None = None, stdout: TextIO | None = None,
             stderr: TextIO | None = None, interactive: bool | None = None) -> int:
    """Read lines from ``stdin`` until end of input or ``/exit``; each line that is not a command
    is a user message, whose reply streams to ``stdout`` and whose :meth:`TurnStats.line` goes
    to ``stderr``. Between turns (and before the first) the session warms up. ``interactive``
    (default: ``stdin`` is a terminal) shows a prompt and a help line; Ctrl-C at the prompt
    clears the line. Returns the exit status (0)."""
    stdin = sys.stdin if stdin is None else stdin
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    if interactive is None:
        interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(HELP, file=stderr, flush=True)

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    try:
        while True:
            session.start_warmup()
            try:
                line = _read_line(stdin, stdout, interactive)
            except EOFError:
                if interactive:
                    print(file=stdout)
                break
            except KeyboardInterrupt:
                print("\n(/exit or Ctrl-D to leave)", file=stderr, flush=True)
                continue
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                cmd = text.split()[0].lower()
                if cmd in ("/exit", "/quit"):
                    break
                if cmd == "/reset":
                    session.reset()
                    print("[conversation reset]", file=stderr, flush=True)
                elif cmd == "/stats":
                    session.finish_warmup()
                    for k, v in session.stats().items():
                        print(f"{k}: {v}", file=stdout)
                    stdout.flush()
                elif cmd == "/help":
                    print(HELP, file=stderr, flush=True)
                else:
                    print(f"unknown command {cmd} ({', '.join(COMMANDS)})", file=stderr,
                          flush=True)
                continue
            try:
                st = session.turn(line, write)
            except (ValueError, RuntimeError) as e:
                print(f"\nerror: {e}" + (" (/reset starts a new conversation)"
                                         if "max_model_len" in str(e) else ""),
                      file=stderr, flush=True)
                continue
            write("\n")
            print(st.line(), file=stderr, flush=True)
    finally:
        session.finish_warmup()
    return 0
