"""What the console shows of a run: Flower's, Ray's and transformers' known-harmless noise filtered out (``ConsoleFilter``), and the exception line that ended a failed run."""


from __future__ import annotations

import collections
import re
from typing import Iterable




ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


LEVELS = "DEBUG|INFO|WARNING|ERROR|CRITICAL"


# Flower's console handler (also used by the fedpower logger): "INFO :      message", optionally
# prefixed by Ray's "(ClientAppActor pid=123) " and with a timestamp in DEBUG mode.
CONSOLE_RE = re.compile(rf"^(?P<actor>\(\w+ pid=\d+\)\s?)?(?P<level>{LEVELS})"
                        rf"(?: \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)? ?:\s?(?P<msg>.*)$")


# The same Flower records a second time through the root logger, which `opacus` configures with
# logging.basicConfig at import ("11/23/2026 14:27:35:ERROR:Simulation raised an exception").
ROOT_RE = re.compile(rf"^(?P<actor>\(\w+ pid=\d+\)\s?)?\d\d/\d\d/\d{{4}} \d\d:\d\d:\d\d:(?P<level>{LEVELS}):(?P<msg>.*)$")


# Known-harmless lines hidden unless --verbose: (pattern searched in the line without colours, why).
# Never add a pattern that could match an ERROR line, a fedpower warning or a traceback.
NOISE_PATTERNS: list[tuple[re.Pattern, str]] = [(re.compile(p), why) for p, why in [
    (r"Since flwr 1\.32, default simulated SuperNodes changed from 10 to 2",
     "Flower notice printed by every run; fedpower-run always passes num-supernodes"),
    (r"To change federation size, use the following command", "Flower hint; use --supernodes"),
    (r"\bflwr federation simulation-config \S+ <superlink> --num-supernodes <N>", "second line of that hint"),
    (r"^Successfully installed \S+ to \S+", "the FAB unpacked into $FLWR_HOME/apps for every run"),
    (r"WARNING :\s+Manually terminating ClientAppActor", "Ray actors stopped at the end of every run"),
    (r"FutureWarning: `is_gradient_checkpointing` is deprecated",
     "transformers deprecation triggered inside PEFT (not our code)"),
    (r"FutureWarning: Tip: In future versions of Ray, Ray will no longer override accelerator",
     "Ray notice printed by every Ray start (fedpower sets the GPU fraction explicitly)"),
    (r"UserWarning: Full backward hook is firing when gradients are computed with respect to module outputs "
     r"since no inputs require gradients", "torch, under Opacus' per-example gradient hooks (see QUIET_ENV)"),
    (r"^(\(\w+ pid=\d+\)\s?)?Loading weights:\s+\d+%\|", "transformers progress bar (one per process)"),
]]


# The source line Python prints under a warning ("  warnings.warn(", "  loss.backward()"): hidden
# only right after a hidden warning.
_WARN_CONTINUATION = re.compile(r"^(\(\w+ pid=\d+\)\s?)?  \S")


TRACEBACK_START = "Traceback (most recent call last):"


_ACTOR = re.compile(r"^\(\w+ pid=\d+\)\s?")


class ConsoleFilter:
    """Decides what of ``flwr run --stream``'s output reaches the console: :meth:`feed` takes one
    line and returns the lines to print now (usually it or nothing; a traceback is held until its
    last line), :meth:`flush` returns what is still held at the end.

    Hidden:

    * lines matching :data:`NOISE_PATTERNS`, and the source line Python prints under a hidden warning;
    * Flower records repeated by the root logger (``opacus`` calls ``logging.basicConfig``): their
      DEBUG records, and repeats of a record already shown together with its continuation lines (the
      repeated traceback) - only lines equal to the ones already shown are dropped;
    * a traceback identical to one already shown (Flower logs a failing ClientApp load twice): it is
      replaced by one line naming its exception, keeping the ERROR record it belongs to;
    * empty log records.

    ERROR and CRITICAL records, the first copy of every traceback and anything unknown always pass.
    """

    MAX_REMEMBERED = 500
    MAX_TRACEBACK = 2000

    def __init__(self) -> None:
        self._blocks: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
        self._current: list[str] | None = None
        self._expect: collections.deque[str] | None = None
        self._hid_warning = False
        self._tb: list[tuple[str, str]] | None = None  # held traceback: (raw line, structure text)
        self._tracebacks: set[tuple[str, ...]] = set()

    def feed(self, line: str) -> list[str]:
        plain = ANSI_RE.sub("", line.rstrip("\r\n"))
        hid_warning, self._hid_warning = self._hid_warning, False
        # 1. root-logger repeats of Flower records
        if self._expect is not None:  # inside a repeated block: drop what was already shown
            if self._expect and plain == self._expect[0]:
                self._expect.popleft()
                return []
            self._expect = None
        record = None
        if m := ROOT_RE.match(plain):
            self._current = None
            msg = m["msg"].strip()
            if m["level"] == "DEBUG":
                return []
            if msg in self._blocks:
                self._expect = collections.deque(self._blocks[msg])
                return []
            record = (m["level"], msg)
        elif m := CONSOLE_RE.match(plain):
            record = (m["level"], m["msg"].strip())
            self._current = self._remember(record[1])
        elif self._current is not None and len(self._current) < 200:
            self._current.append(plain)
        # 2. tracebacks: held until complete, shown once
        text = record[1] if record else _ACTOR.sub("", plain)
        out: list[str] = []
        if self._tb is not None:
            if text != TRACEBACK_START:
                self._tb.append((line, text))
                if (text[:1] not in (" ", "\t") or not text) or len(self._tb) > self.MAX_TRACEBACK:
                    return self._close_traceback()  # the exception line (or the block broke off)
                return []
            out = self._close_traceback()
        if text == TRACEBACK_START:
            self._tb = [(line, text)]
            return out
        # 3. noise
        if record is not None:
            level, msg = record
            if level in ("ERROR", "CRITICAL"):
                return out + [line]
            return out + ([line] if msg and not self._noise(plain) else [])
        if hid_warning and _WARN_CONTINUATION.match(plain):
            return out
        if self._noise(plain):
            self._hid_warning = "Warning:" in plain
            return out
        if re.fullmatch(r"\(\w+ pid=\d+\)\s*", plain):  # Ray's prefix before a progress bar
            return out
        return out + [line]

    def flush(self) -> list[str]:
        return self._close_traceback() if self._tb is not None else []

    def _close_traceback(self) -> list[str]:
        block, self._tb = self._tb or [], None
        key = tuple(text for _, text in block)
        if key not in self._tracebacks:
            self._tracebacks.add(key)
            return [raw for raw, _ in block]
        first = block[0][0]
        exc = block[-1][1].strip() if len(block) > 1 else ""
        note = f"(the same traceback as above{': ' + exc if exc else ''})"
        return [first.replace(TRACEBACK_START, note, 1)]

    def _remember(self, msg: str) -> list[str]:
        block: list[str] = []
        self._blocks[msg] = block
        self._blocks.move_to_end(msg)
        while len(self._blocks) > self.MAX_REMEMBERED:
            self._blocks.popitem(last=False)
        return block

    @staticmethod
    def _noise(plain: str) -> bool:
        return any(p.search(plain) for p, _ in NOISE_PATTERNS)


def filter_lines(lines: Iterable[str]) -> list[str]:
    """The lines :class:`ConsoleFilter` lets through, in order (for tests and post-processing)."""
    f = ConsoleFilter()
    out = [kept for line in lines for kept in f.feed(line)]
    return out + f.flush()


_EXC_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?(?P<name>[A-Z]\w*(?:Error|Exception|Exhausted|Interrupt|Exit))"
                       r"(?::\s*(?P<msg>.*))?$")


_CHAINED = ("The above exception was the direct cause of the following exception:",
            "During handling of the above exception, another exception occurred:")


def last_exception_line(output: str) -> str | None:
    """The exception that ended the last traceback in ``output``, as ``SomeError: message`` (module
    path removed). For chained exceptions, the first of the chain (the cause, not Flower's wrapper)."""
    found = None
    chained = False
    for line in output.splitlines():
        plain = _ACTOR.sub("", ANSI_RE.sub("", line).strip()).strip()
        if plain in _CHAINED:
            chained = True
        elif (m := _EXC_LINE.match(plain)) and m["msg"] is not None:
            if not chained:
                found = f"{m['name']}: {m['msg']}"
            chained = False
    return found
