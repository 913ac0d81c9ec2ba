"""A model's chat template is untrusted code: it renders in a child process bounded in time,
memory and output size, a stuck render holds no front thread and blocks no shutdown, a
template that is not valid Jinja is refused at load, and one that cannot render a small
conversation within the bounds is refused when the server starts."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from slotserve.checkpoint import load_tokenizer
from slotserve.checkpoint.chat_render import ChatRenderer, ChatTemplateError
from slotserve.entrypoints.async_llm import AsyncLLM
from slotserve.entrypoints.openai.api_server import build_app
from slotserve.errors import ModelLoadError
from tests.entrypoints.conftest import LoopThread, loop_thread, start_server  # noqa: F401
from tests.helpers import build_bigram_model

PLAIN = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# Not a constant: Jinja's compiler would fold `'a' * 3000000000` while compiling.
HUGE = "{{ 'a' * (3000000000 + messages | length) }}"
# Hostile only when asked: the probe at start passes, a client's "spin" holds the render.
TRIGGERED = ("{% if messages[-1]['content'] == 'spin' %}" + SPIN + "{% endif %}"
             "{% if messages[-1]['content'] == 'huge' %}" + HUGE + "{% endif %}" + PLAIN)
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def renderer(tokenizer: Any) -> Iterator[ChatRenderer]:
    r = ChatRenderer(tokenizer, timeout_s=1.0, max_output_chars=10_000)
    yield r
    r.close()


def test_renders_what_transformers_renders(renderer: ChatRenderer, tokenizer: Any) -> None:
    for template in (PLAIN, TRIGGERED):
        expected = tokenizer.apply_chat_template(HELLO, tokenize=False, chat_template=template,
                                                 add_generation_prompt=True)
        assert renderer.render(HELLO, chat_template=template,
                               add_generation_prompt=True) == expected


def test_the_child_renders_special_tokens_without_the_vocabulary(renderer: ChatRenderer,
                                                                 tokenizer: Any) -> None:
    """The child holds the template and the special tokens map, not the tokenizer: the
    variables transformers gives a template still reach it, and a caller's win."""
    from slotserve.checkpoint.chat_render import _render_spec

    spec = _render_spec(tokenizer)
    assert spec[0] == "template" and spec[2] == tokenizer.special_tokens_map
    assert len(renderer._payload()) < 10_000  # not the pickled vocabulary
    template = ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{{ pad_token }}{{ extra | default('-') }}")
    for kwargs in ({}, {"bos_token": "<B>", "extra": "x"}):
        expected = tokenizer.apply_chat_template(HELLO, tokenize=False, chat_template=template,
                                                 **kwargs)
        assert renderer.render(HELLO, chat_template=template, **kwargs) == expected
        assert expected.startswith(kwargs.get("bos_token", tokenizer.bos_token or ""))


@pytest.mark.parametrize(("template", "message"), [
    (SPIN, "took longer than 1 s"),
    (HUGE, "more memory than the limit"),
    ("{% for i in range(100000) %}" * 2 + "x" + "{% endfor %}" * 2, "took longer than 1 s"),
    ("{% for i in range(20000) %}0123456789{% endfor %}", "more than the limit of 10000"),
])
def test_hostile_render_is_bounded(renderer: ChatRenderer, template: str,
                                   message: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message) as info:
        renderer.render(HELLO, chat_template=template)
    assert info.value.param == "messages"
    assert time.monotonic() - start < 20  # the bound, plus a fresh child under load
    # The next render is served (by a fresh child where the old one was killed).
    assert renderer.render(HELLO, chat_template=PLAIN).startswith("<|user|>hello")


def test_template_refusal_is_the_clients(renderer: ChatRenderer) -> None:
    with pytest.raises(ChatTemplateError, match="cannot apply the chat template: roles"):
        renderer.render(HELLO, chat_template="{{ raise_exception('roles must alternate') }}")


def test_close_ends_a_stuck_render(tokenizer: Any) -> None:
    r = ChatRenderer(tokenizer, timeout_s=600.0, workers=1)
    r.render(HELLO, chat_template=PLAIN)  # warm
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(r.render, HELLO, chat_template=SPIN)
        time.sleep(0.5)
        start = time.monotonic()
        r.close()
        with pytest.raises(ChatTemplateError):
            stuck.result(timeout=30)
    assert time.monotonic() - start < 30


def test_probe_keeps_no_render_process(tokenizer: Any) -> None:
    """The start-up probe's child ends after it (a server without chat requests keeps no
    render process resident); the next render starts a fresh one and renders the same."""
    r = ChatRenderer(tokenizer, timeout_s=30.0, workers=1)
    try:
        r.probe()
        assert not any(child.alive() for child in r._children)
        expected = tokenizer.apply_chat_template(HELLO, tokenize=False, chat_template=PLAIN)
        assert r.render(HELLO, chat_template=PLAIN) == expected
        assert sum(child.alive() for child in r._children) == 1
    finally:
        r.close()


def test_render_children_run_below_the_servers_priority(tokenizer: Any) -> None:
    """A client's render (and a fresh child's imports) yields the CPU to the engine; the
    probe at start, with nothing to compete with, runs at the server's own priority."""
    import os

    base = os.getpriority(os.PRIO_PROCESS, 0)
    r = ChatRenderer(tokenizer, timeout_s=30.0, workers=1, nice=7)
    try:
        r.release_idle = lambda: None  # type: ignore[method-assign]  # keep the probe's child
        r.probe()
        (child,) = [c for c in r._children if c.alive()]
        assert os.getpriority(os.PRIO_PROCESS, child.process.pid) == base
        ChatRenderer.release_idle(r)
        assert r.render(HELLO, chat_template=PLAIN)
        (child,) = [c for c in r._children if c.alive()]
        assert os.getpriority(os.PRIO_PROCESS, child.process.pid) == min(base + 7, 19)
    finally:
        r.close()


def test_invalid_jinja_refused_at_load(tmp_path: Path, tokenizer: Any) -> None:
    tokenizer.save_pretrained(tmp_path)
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }"
        tokenizer.save_pretrained(tmp_path)
    finally:
        tokenizer.chat_template = original
    with pytest.raises(ModelLoadError, match=r"not valid Jinja \(line 1"):
        load_tokenizer(tmp_path)


def _model(folder: Path, tokenizer_dir: Path, template: str) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = template
    build_bigram_model(folder, tok, [])
    return folder


def _engine(folder: Path) -> AsyncLLM:
    return AsyncLLM.from_engine_args(model=str(folder), engine_mode="thread", threads=1,
                                     dtype="float32", device="cpu", max_model_len=256,
                                     num_blocks=64, max_num_seqs=4, check=True, seed=0)


def test_server_refuses_a_template_that_fails_its_probe(tmp_path: Path,
                                                        tokenizer_dir: Path) -> None:
    engine = _engine(_model(tmp_path, tokenizer_dir, SPIN + PLAIN))
    engine.processor.chat_renderer.timeout_s = 1.0
    try:
        with pytest.raises(ModelLoadError, match="probe render.*took longer than 1 s"):
            build_app(engine, served_model_names=["m"], shutdown_engine=False)
    finally:
        engine.shutdown()


def test_stuck_renders_hold_no_front_thread(loop_thread: LoopThread,  # noqa: F811
                                            tmp_path: Path, tokenizer_dir: Path) -> None:
    engine = _engine(_model(tmp_path, tokenizer_dir, TRIGGERED))
    engine.processor.chat_renderer.timeout_s = 3.0
    server = start_server(loop_thread, build_app(engine, served_model_names=["m"],
                                                 shutdown_engine=False))
    url = server.base_url
    try:
        def chat(content: str) -> httpx.Response:
            return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "model": "m", "messages": [{"role": "user", "content": content}],
                "max_tokens": 2})

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            spins = [pool.submit(chat, "spin") for _ in range(2)]
            time.sleep(1.0)
            # In-thread renders held both front threads for good; here each waits for its
            # render's bound at most, and the plain request is served after it.
            start = time.monotonic()
            plain = httpx.post(f"{url}/v1/completions", timeout=60,
                               json={"model": "m", "prompt": "hi", "max_tokens": 2})
            assert plain.status_code == 200 and time.monotonic() - start < 20
            for spin in spins:
                r = spin.result(timeout=120)
                assert r.status_code == 400
                assert r.json()["error"]["param"] == "messages"
                assert "took longer than 3 s" in r.json()["error"]["message"]
        huge = chat("huge")
        assert huge.status_code == 400 and "memory" in huge.json()["error"]["message"]
        assert chat("hello").status_code == 200
    finally:
        start = time.monotonic()
        server.stop()
        engine.shutdown()
    assert time.monotonic() - start < 30
