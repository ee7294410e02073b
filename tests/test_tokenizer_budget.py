"""A tokenizer.json is input too: its regexes are checked before the tokenizers library compiles them (nested or
alternating unbounded repetition is refused: Oniguruma backtracks exponentially on it), and a failure inside the
library on one text is one line, not a Rust panic."""

import time

import pytest

from q38.errors import DataError
from q38.train.data.tokenizer import load_tokenizer, risky_repetition

# pre-tokenizer patterns of released tokenizers (Qwen2/3.x, GPT-2, Llama 3): accepted
RELEASED = [
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
HOSTILE = [r"(a+)+b", r"(?:a|ab)*c", r"((x*)y)+z", r"(\s*\w+){2,}$"]


@pytest.mark.parametrize("pattern", RELEASED)
def test_released_patterns_pass(pattern):
    assert risky_repetition(pattern) is None


@pytest.mark.parametrize("pattern", HOSTILE)
def test_nested_or_alternating_repetition_is_found(pattern):
    assert risky_repetition(pattern) is not None
    assert risky_repetition(pattern.replace("+", "?").replace("*", "?").replace("{2,}", "{2,3}")) is None


def _save(tmp_path, pattern):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_a_hostile_tokenizer_is_refused_before_the_library_reads_it(tmp_path):
    """The same tokenizer without q38's check: the library takes exponential time, then panics (its retry limit);
    with it, loading is refused in one line naming the file and the group."""
    from tokenizers import Tokenizer

    d = _save(tmp_path, r"(a+)+b")
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    t0 = time.perf_counter()
    raw.encode("a" * 18 + "c")
    t18 = time.perf_counter() - t0
    t0 = time.perf_counter()
    raw.encode("a" * 21 + "c")
    assert time.perf_counter() - t0 > 3 * t18  # the attack is real: each extra 'a' doubles the work
    with pytest.raises(DataError, match=r"tokenizer\.json: the regex '\(a\+\)\+b' repeats the group '\(a\+\)\+'"):
        load_tokenizer(d)


def test_a_panic_inside_the_library_is_one_line(tmp_path, monkeypatch):
    import q38.train.data.tokenizer as T

    d = _save(tmp_path, r"(a+)+b")
    monkeypatch.setattr(T, "risky_repetition", lambda p: None)  # let it through, as a pattern the check misses would be
    tok = load_tokenizer(d)
    with pytest.raises(DataError, match=r"the tokenizers library failed on a text of 41 characters \(.*retry-limit"):
        tok.encode("a" * 40 + "c")


def test_an_oversized_pattern_is_refused(tmp_path):
    with pytest.raises(DataError, match=r"a regex of 5,000 characters \(the limit is 4,096\)"):
        load_tokenizer(_save(tmp_path, "a" * 5000))
