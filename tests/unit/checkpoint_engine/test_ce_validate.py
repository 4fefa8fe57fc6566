"""`check_literals`: every Literal-annotated field of a config dataclass checked from its annotation."""

from __future__ import annotations

import dataclasses
from typing import Literal

import pytest

from checkpoint_engine.config import ParameterServerConfig
from ckpt_common.validate import check_literals, check_qualname, choices_text, import_qualname

Mode = Literal["fast", "slow"]


@dataclasses.dataclass(frozen=True)
class Example:
    mode: Mode = "fast"
    backend: Literal["a", "b", "c"] | None = None
    count: int = 1  # not a Literal: never checked here

    def __post_init__(self) -> None:
        check_literals(self, "example.")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"mode": "medium"}, "example.mode='medium' must be 'fast' or 'slow'"),
        ({"mode": None}, "example.mode=None must be 'fast' or 'slow'"),
        ({"backend": "d"}, "example.backend='d' must be 'a', 'b', 'c' or None"),
        ({"mode": "FAST"}, "example.mode='FAST' must be 'fast' or 'slow'"),
    ],
)
def test_a_value_outside_the_literal_names_the_field_and_the_choices(kwargs, message):
    with pytest.raises(ValueError) as e:
        Example(**kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize("kwargs", [{}, {"mode": "slow"}, {"backend": "c"}, {"backend": None}, {"count": -5}])
def test_allowed_values_pass(kwargs):
    Example(**kwargs)


def test_choices_text():
    assert choices_text(("x",)) == "'x'"
    assert choices_text(("x", "y", None)) == "'x', 'y' or None"


def test_a_package_config_uses_it():
    with pytest.raises(ValueError, match=r"^transport='tpu' must be 'auto', 'cpu' or 'cuda'$"):
        ParameterServerConfig(transport="tpu")


@pytest.mark.parametrize("value", ["nomodule", ":attr", "module:", "", None, 3])
def test_a_qualname_without_module_and_attr_names_the_field(value):
    with pytest.raises(ValueError, match=r"reward\.reward_model=.* must look like 'module:attr'"):
        check_qualname("reward.reward_model", value)


def test_import_qualname_gives_the_object_or_names_what_cannot_be_loaded():
    assert import_qualname("x", "ckpt_common.validate:check_qualname") is check_qualname
    with pytest.raises(ValueError, match=r"x='no_such_module_here:f' cannot be loaded: No module named"):
        import_qualname("x", "no_such_module_here:f")
    with pytest.raises(ValueError, match=r"x='ckpt_common.validate:nothing' cannot be loaded: .*nothing"):
        import_qualname("x", "ckpt_common.validate:nothing")
