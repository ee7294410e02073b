"""A chat template is code shipped with a tokenizer: one rendering runs under a time and a size budget
(``q38.train.data.chat``: ``RENDER_SECONDS``, ``RENDER_CHARS``, ``POWER_BITS``) and a template past it is one
``DataError`` naming the template and the limit (issue 35)."""

import threading
import time

import pytest

import q38.train.data.chat as chat
from q38.train.data.loader import DataError
from q38.train.data.tokenizer import load_tokenizer
from tests.test_chat import _make_tokenizer_dir

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def _format(tmp_path, template: str):
    return chat.load_chat_format(load_tokenizer(str(_make_tokenizer_dir(tmp_path / "tok", template))))


def _render(fmt):
    return fmt.render(MESSAGES, None, add_generation_prompt=False)


def test_a_template_that_loops_is_stopped_at_the_time_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
    # ~10^8 loop iterations, no output: minutes of pure Python without the deadline
    fmt = _format(tmp_path, "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x")
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=r"chat template 'default' of .*tokenizer_config.json chat_template ran "
                                        r"longer than 0.3 s for one record \(the limit on one rendering\)"):
        _render(fmt)
    assert time.perf_counter() - t0 < 3
    time.sleep(0.4)  # past another deadline: nothing is left armed or pending for this thread
    ok = _format(tmp_path / "b", "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert _render(ok)[0] == "hihello"


def test_the_time_limit_holds_on_another_thread(tmp_path, monkeypatch):
    """The data loader may render on a prefetch thread: the deadline is per rendering thread."""
    monkeypatch.setattr(chat, "RENDER_SECONDS", 0.3)
    fmt = _format(tmp_path, "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}")
    got = []

    def run():
        try:
            _render(fmt)
        except DataError as e:
            got.append(str(e))

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not t.is_alive() and got and "ran longer than 0.3 s" in got[0]


def test_a_template_that_renders_too_much_is_stopped_at_the_size_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(chat, "RENDER_CHARS", 1 << 20)
    fmt = _format(tmp_path, "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}")  # 100 MB
    with pytest.raises(DataError, match=r"rendered more than 1,048,576 characters for one record \(the limit\)"):
        _render(fmt)


@pytest.mark.parametrize("expr, needle", [("'x' * 10**10", "a repetition of 1 x 10,000,000,000 is over the"),
                                          ("[1] * 10**9", "a repetition of 1 x 1,000,000,000"),
                                          ("2 ** 100000000", "is over the 4096-bit limit")])
def test_one_huge_operation_is_refused_before_it_runs(tmp_path, expr, needle):
    """Single C-level operations the deadline could not interrupt (a 10 GB string, a 10^8-digit power)."""
    fmt = _format(tmp_path, "{{ " + expr + " }}")
    t0 = time.perf_counter()
    with pytest.raises(DataError, match=needle):
        _render(fmt)
    assert time.perf_counter() - t0 < 2


def test_ordinary_arithmetic_is_unchanged(tmp_path):
    fmt = _format(tmp_path, "{{ '-' * 3 }}{{ 2 ** 10 }}{{ [0] * 2 }}{{ 3 * 4 }}")
    assert _render(fmt)[0] == "---1024[0, 0]12"
