"""A model's chat template, rendered in a child process bounded in time and memory.

A chat template is code from the model file. transformers runs it in Jinja's sandbox, which
keeps it from the host but not from the CPU or the heap: nested `range(100000)` loops run
for hours holding the thread that renders, `{{ 'a' * 3000000000 }}` allocates gigabytes.
A thread cannot be stopped, so templates render in a child process (transformers' own
`apply_chat_template` there, so the text is exactly what it renders): a render past
`timeout_s` kills the child (a fresh one starts for the next render), the child's address
space is capped so a huge string is a MemoryError there, and an output over
`max_output_chars` is refused. The front thread only waits on a pipe with a deadline, so
neither a stuck render nor shutdown can hang on it. Rendering happens apart from
tokenization, which stays in the front. The children run at a lower priority than the
server (`RENDER_NICE`), so a template's CPU comes out of what the engine leaves.

The child gets only what `apply_chat_template(tokenize=False)` reads: the template and the
special tokens map (which transformers passes to the template), on a tokenizer with an empty
vocabulary, so it runs transformers' own code without holding a second copy of the
vocabulary (for Gemma's 262k tokens: about 70 MB and a second to start instead of 360 MB
and five). A tokenizer class with its own `apply_chat_template` is sent whole.

`check_template_syntax` (Jinja's parser only, which runs no template code) refuses a template
that is not valid Jinja when the tokenizer is loaded; `ChatRenderer.probe()` renders a small
conversation once at server start, so a template that cannot render it within the bounds is
refused before any client sees it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from slotserve.errors import ModelLoadError, RequestValidationError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_MAX_OUTPUT_CHARS = 16 << 20
# What a render may allocate beyond the child's footprint once it holds the tokenizer.
DEFAULT_RENDER_BYTES = 1 << 30
# Children that render clients' chats run below the engine's priority, so a template's work
# (and a fresh child's second or so of imports, which a server's first chat request pays)
# takes the CPU the engine's steps leave, not theirs. The probe's child renders at server
# start, when nothing competes, at the server's own priority.
RENDER_NICE = 10
PROBE_CONVERSATION = [{"role": "system", "content": "You are helpful."},
                      {"role": "user", "content": "Hello"},
                      {"role": "assistant", "content": "Hi."},
                      {"role": "user", "content": "Bye"}]


# A fresh child (an interpreter importing transformers, the tokenizer built) says it has
# loaded and waits for renders; it has this long to get there, apart from the render's bound.
_READY = ("ready", None)
_STARTUP_TIMEOUT_S = 60.0


class ChatTemplateError(RequestValidationError):
    """The template refused these messages (its own `raise_exception`), or rendering them
    ran past a bound."""


def check_template_syntax(template: str | None, source: str) -> None:
    """ModelLoadError when `template` is not valid Jinja (parsing runs none of its code)."""
    if not template:
        return
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    # transformers adds a {% generation %} block tag; parse it as an ordinary one here.
    text = template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    text = text.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"{source}: the chat template is not valid Jinja (line "
                             f"{exc.lineno}: {exc.message})") from exc


class ChatRenderer:
    """Renders through child processes, at most `workers` at once (the front's threads)."""

    def __init__(self, tokenizer: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
                 render_bytes: int = DEFAULT_RENDER_BYTES, workers: int = 2,
                 nice: int = RENDER_NICE) -> None:
        self.timeout_s = timeout_s
        self.nice = nice
        self.max_output_chars = max_output_chars
        self.render_bytes = render_bytes
        self._tokenizer_bytes: bytes | None = None
        self._tokenizer = tokenizer
        # Last in, first out: the child that rendered last (warm) renders next.
        self._idle: queue.LifoQueue[_Child | None] = queue.LifoQueue()
        for _ in range(workers):
            self._idle.put(None)  # started on first use
        self._lock = threading.Lock()
        self._children: set[_Child] = set()
        self._closed = False
        # A renderer dropped without close() still ends its children.
        weakref.finalize(self, _kill_all, self._children)

    def _payload(self) -> bytes:
        with self._lock:
            if self._tokenizer_bytes is None:
                self._tokenizer_bytes = pickle.dumps(_render_spec(self._tokenizer))
            return self._tokenizer_bytes

    def render(self, conversation: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """The template's text for a conversation (kwargs as for apply_chat_template, without
        `tokenize`); ChatTemplateError (param "messages") when it cannot be rendered."""
        return self._render(conversation, self.nice, kwargs)

    def _render(self, conversation: Sequence[Mapping[str, Any]], nice: int,
                kwargs: dict[str, Any]) -> str:
        """render(), a child started here running at `nice`."""
        if self._closed:
            raise ChatTemplateError("the server is shutting down", "messages")
        child = self._idle.get()
        try:
            if child is None or not child.alive():
                child = self._start(nice)
            status, value = child.call((list(conversation), kwargs), self.timeout_s)
        except TimeoutError:
            assert child is not None
            self._kill(child)
            child = None
            raise ChatTemplateError(f"rendering the chat template took longer than "
                                    f"{self.timeout_s:g} s", "messages") from None
        except (EOFError, OSError):
            if child is not None:
                self._kill(child)
            child = None
            raise ChatTemplateError("rendering the chat template failed (its process ended)",
                                    "messages") from None
        finally:
            self._idle.put(child)
        if status == "ok":
            if len(value) > self.max_output_chars:
                raise ChatTemplateError(
                    f"the chat template rendered {len(value)} characters, more than the "
                    f"limit of {self.max_output_chars}", "messages")
            return str(value)
        if status == "too_long":
            raise ChatTemplateError(
                f"the chat template rendered {value} characters, more than the limit of "
                f"{self.max_output_chars}", "messages")
        if status == "template":
            raise ChatTemplateError(f"cannot apply the chat template: {value}", "messages")
        if status == "memory":
            raise ChatTemplateError("rendering the chat template took more memory than the "
                                    f"limit of {self.render_bytes >> 20} MiB", "messages")
        logger.warning("the chat template failed: %s", value)
        raise ChatTemplateError("cannot apply the chat template to these messages", "messages")

    def probe(self, source: str = "the model") -> None:
        """Render a small conversation; ModelLoadError when the template cannot within the
        bounds (its own refusal of these messages is not a failure: the template decides).
        The probe's child ends afterwards: a server that never sees a chat request does not
        keep ~75 MB resident for it (the first chat request starts one, about a second)."""
        try:
            self._render(PROBE_CONVERSATION, 0, {"add_generation_prompt": True})
        except ChatTemplateError as exc:
            if not str(exc).startswith("cannot apply the chat template: "):
                raise ModelLoadError(f"{source}: the chat template failed a probe render: "
                                     f"{exc}") from exc
        finally:
            self.release_idle()

    def release_idle(self) -> None:
        """End the children that are not rendering now; later renders start fresh ones."""
        idle: list[_Child | None] = []
        with contextlib.suppress(queue.Empty):
            while True:
                idle.append(self._idle.get_nowait())
        for child in idle:
            if child is not None:
                self._kill(child)
            self._idle.put(None)

    def _start(self, nice: int) -> _Child:
        child = _Child(self._payload(), self.max_output_chars, self.render_bytes, nice)
        with self._lock:
            self._children.add(child)
        return child

    def _kill(self, child: _Child) -> None:
        child.kill()
        with self._lock:
            self._children.discard(child)

    def close(self) -> None:
        """Kill every child now (a render in progress fails at once)."""
        self._closed = True
        with self._lock:
            _kill_all(self._children)


def _kill_all(children: set[_Child]) -> None:
    for child in list(children):
        child.kill()
    children.clear()


class _Child:
    """A fresh interpreter (not multiprocessing's spawn, which would re-run the caller's
    main module) on one end of a socket pair."""

    def __init__(self, tokenizer_bytes: bytes, max_output_chars: int, render_bytes: int,
                 nice: int) -> None:
        ours, theirs = socket.socketpair()
        # Lowered before any import: the imports are most of a fresh child's work.
        code = (f"import os; os.nice({int(nice)}); "
                f"from slotserve.checkpoint.chat_render import _main; "
                f"_main({theirs.fileno()}, {max_output_chars}, {render_bytes})")
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send_bytes(tokenizer_bytes)
        self._lock = threading.Lock()
        self._warm = False

    def alive(self) -> bool:
        return self.process.poll() is None

    def call(self, request: Any, timeout_s: float) -> tuple[str, Any]:
        with self._lock:
            if not self._warm:
                # The child first imports transformers and loads the tokenizer (about a
                # second): not part of the render's time, which stays exactly `timeout_s`.
                if not self.conn.poll(_STARTUP_TIMEOUT_S) or self.conn.recv() != _READY:
                    raise TimeoutError
                self._warm = True
            self.conn.send(request)
            if not self.conn.poll(timeout_s):
                raise TimeoutError
            result: tuple[str, Any] = self.conn.recv()
            return result

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        self.conn.close()


def _render_spec(tokenizer: Any) -> tuple[Any, ...]:
    """What the child needs to render as `tokenizer` does (see the module docstring)."""
    from slotserve.checkpoint.saved_tokenizer import SavedTokenizer

    if isinstance(tokenizer, SavedTokenizer):  # checked first: the front has no transformers
        return ("template", tokenizer.chat_template, dict(tokenizer.special_tokens_map))
    from transformers import PreTrainedTokenizerBase

    if (isinstance(tokenizer, PreTrainedTokenizerBase) and type(tokenizer).apply_chat_template
            is PreTrainedTokenizerBase.apply_chat_template):
        return ("template", tokenizer.chat_template, dict(tokenizer.special_tokens_map))
    return ("tokenizer", tokenizer)


def _renderer(spec: tuple[Any, ...]) -> tuple[Any, dict[str, Any]]:
    """The tokenizer to render with, and the template variables it does not hold itself."""
    if spec[0] == "tokenizer":
        return spec[1], {}
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    # No special tokens of its own (an empty map), so passing the real map as template
    # variables gives the template exactly the variables the real tokenizer would.
    empty = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    stub = PreTrainedTokenizerFast(tokenizer_object=empty)  # type: ignore[no-untyped-call]
    stub.chat_template = spec[1]
    return stub, spec[2]


def _main(fd: int, max_output_chars: int, render_bytes: int) -> None:
    """The child: load the tokenizer, cap the address space, render until the pipe closes."""
    import resource
    import signal

    from jinja2 import TemplateError

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when it ends
    with contextlib.suppress(Exception):  # Linux: die with the parent, even mid-render
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    conn = Connection(fd)

    tokenizer, variables = _renderer(pickle.loads(conn.recv_bytes()))
    try:
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (size + render_bytes, size + render_bytes))
    except (OSError, ValueError):
        pass  # no /proc or no limit to set: the time bound still holds
    conn.send(_READY)
    while True:
        try:
            conversation, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 **{**variables, **kwargs})
            reply: tuple[str, Any] = (("ok", text) if len(text) <= max_output_chars
                                      else ("too_long", len(text)))
        except MemoryError:
            reply = ("memory", None)
        except TemplateError as exc:
            reply = ("template", str(exc)[:500])
        except Exception as exc:  # noqa: BLE001 - a template bug, reported to the parent
            reply = ("error", f"{type(exc).__name__}: {str(exc)[:500]}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
