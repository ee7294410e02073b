"""q38/schema.py: YAML 1.1 number strings become floats; every other wrong type or range is one ConfigError
naming section.key, the value and the expectation; a new field needs only its annotation (+ optional validator)."""

import attrs
import pytest

from q38.model_config import ConfigError
from q38.train.core.step_config import TrainConfig
from q38.schema import in_range, one_of, structure
from tests.run_utils import run_dict


def test_yaml_1_1_exponent_numbers_are_floats(tmp_path):
    from q38.train.run.trainer import RunConfig

    import yaml

    d = run_dict(tmp_path / "out")
    d["train"] = {"lr": "@lr", "eps": "@eps", "total_steps": "@ts", "weight_decay": "@wd"}
    text = yaml.safe_dump(d)
    for k, v in (("'@lr'", "3e-4"), ("'@eps'", "1.0e-8"), ("'@ts'", "1e3"), ("'@wd'", "1e-2")):
        text = text.replace(k, v)
    p = tmp_path / "run.yaml"
    p.write_text(text)

    assert yaml.safe_load(p.read_text())["train"]["lr"] == "3e-4"  # what PyYAML (YAML 1.1) gives
    t = RunConfig.from_yaml(p).train
    assert (t.lr, t.eps, t.total_steps, t.weight_decay) == (3e-4, 1e-8, 1000, 1e-2)
    assert isinstance(t.total_steps, int) and isinstance(t.lr, float)


@pytest.mark.parametrize("d,message", [
    ({"beta1": 2}, r"^train\.beta1 must be in \[0, 1\), got 2$"),
    ({"lr": "fast"}, r"^train\.lr must be a number, got 'fast'$"),
    ({"total_steps": 1e3 + 0.5}, r"^train\.total_steps must be an integer, got 1000\.5$"),
    ({"recompute": "yes"}, r"^train\.recompute must be true or false, got 'yes'$"),
    ({"grad_clip": "x"}, r"^train\.grad_clip must be a number or null, got 'x'$"),
    ({"lr": 1, "warmup_steps": 5000}, r"^train\.warmup_steps \(5000\) must be between 0 and total_steps"),
])
def test_one_message_names_key_value_and_expectation(d, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_dict(d)


def test_a_new_field_needs_only_an_annotation_and_an_optional_validator():
    @attrs.frozen(kw_only=True)
    class Extra:
        param_dtype: str = attrs.field(default="float32", validator=one_of("float32", "bfloat16"))
        coef: float | None = attrs.field(default=None, validator=in_range(0, 1))
        layers: int = 2
        names: tuple[str, ...] = ()

    assert structure(Extra, {"coef": "5e-1", "layers": 4.0, "names": ["a"]}, "train") == \
        Extra(coef=0.5, layers=4, names=("a",))
    for d, msg in (({"param_dtype": "fp8"}, "train.param_dtype must be one of float32, bfloat16, got 'fp8'"),
                   ({"coef": 2}, "train.coef must be in [0, 1], got 2"),
                   ({"layers": "two"}, "train.layers must be an integer, got 'two'"),
                   ({"names": [1]}, "train.names must be a list of strings, got [1]"),
                   ({"nmes": []}, "unknown key(s) in section 'train': 'nmes' (did you mean 'names'?)")):
        with pytest.raises(ConfigError) as e:
            structure(Extra, d, "train")
        assert str(e.value).startswith(msg), str(e.value)
