"""Values checked where they enter: the configuration objects by exact type and bound in
__post_init__ ("false" is not a bool, a dict is not a config), and the entry points' own
validators (bridgecache.runtime.inputs), each with the message that names what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bridgecache import HandoffConfig, RefreshConfig
from bridgecache.runtime.fields import FieldTypeError
from bridgecache.runtime.gate import QualityPolicy
from bridgecache.runtime.inputs import check_config, check_contexts, check_fits, check_messages, check_text
from bridgecache.runtime.selection.rules import KeyDeviation, SourceAttention

NAN = float("nan")


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: HandoffConfig(key_norm="false"), r"HandoffConfig.key_norm='false'; expected True or False"),
        (lambda: HandoffConfig(key_norm=1), r"key_norm=1; expected True or False, not a int"),
        (lambda: HandoffConfig(key_norm=None), r"key_norm=None"),
        (lambda: HandoffConfig(one_launch="true"), r"one_launch='true'; expected None, True or False"),
        (lambda: HandoffConfig(cuda_graphs=0), r"cuda_graphs=0"),
        (lambda: HandoffConfig(native_head="3"), r"native_head='3'; expected a count of context tokens"),
        (lambda: HandoffConfig(native_head=1.0), r"native_head=1.0"),
        (lambda: HandoffConfig(native_tail=True), r"native_tail=True"),
        (lambda: HandoffConfig(native_layers=2.5), r"native_layers=2.5"),
        (lambda: HandoffConfig(native_layers=[0, "1"]), r"native_layers\[1\]='1'; expected a layer index"),
        (lambda: HandoffConfig(native_layers=True), r"native_layers=True"),
        (
            lambda: HandoffConfig(refresh={"amount": 0.1}),
            r"refresh=\{'amount': 0.1\}.*not a dict \(from a dict: RefreshConfig\(\*\*options\)\)",
        ),
        (lambda: HandoffConfig(refresh=0.2), r"refresh=0.2; expected a RefreshConfig or None"),
        (lambda: HandoffConfig(quality={"min_quality": 0.5}), r"quality=.*expected a QualityPolicy"),
        (lambda: HandoffConfig(quality=None), r"quality=None"),
        (lambda: RefreshConfig(amount="0.2"), r"RefreshConfig.amount='0.2'"),
        (lambda: RefreshConfig(amount=True), r"RefreshConfig.amount=True"),
        (lambda: RefreshConfig(by=None), r"RefreshConfig.by=None"),
        (lambda: RefreshConfig(whole_words="no"), r"whole_words.*='no'"),
        (lambda: RefreshConfig(word_ends=0), r"word_ends=0"),
        (lambda: QualityPolicy(min_quality="0.7"), r"min_quality.*='0.7'"),
        (lambda: QualityPolicy(max_native_fraction=None), r"max_native_fraction=None"),
        (lambda: QualityPolicy(min_coverage=True), r"min_coverage=True"),
        (lambda: SourceAttention(after="4"), r"SourceAttention.after='4'"),
        (lambda: SourceAttention(recent=2.0), r"SourceAttention.recent=2.0"),
        (lambda: KeyDeviation(check_layer="1"), r"KeyDeviation.check_layer='1'"),
    ],
)
def test_a_field_of_the_wrong_type_is_a_type_error_naming_it(make, message):
    with pytest.raises(TypeError, match=message) as raised:
        make()
    assert isinstance(raised.value, ValueError)  # FieldTypeError: callers that caught ValueError still do
    assert isinstance(raised.value, FieldTypeError)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: HandoffConfig(native_head=-1), "native_head=-1; expected a count of context tokens >= 0"),
        (lambda: HandoffConfig(native_layers=[0, -2]), r"native_layers\[1\]=-2"),
        (lambda: HandoffConfig(native_layers="most"), "native_layers='most'"),
        (lambda: RefreshConfig(amount=NAN), "RefreshConfig.amount=nan"),
        (lambda: RefreshConfig(amount=0), "RefreshConfig.amount=0"),
        (lambda: RefreshConfig(by="attention"), "refresh by 'attention'"),
        (lambda: QualityPolicy(min_quality=NAN), "min_quality.*=nan"),
        (lambda: QualityPolicy(min_quality=1.5), r"min_quality.*=1.5; expected a finite number <= 1.0"),
        (lambda: QualityPolicy(min_coverage=-0.1), "min_coverage=-0.1"),
        (lambda: QualityPolicy(max_native_fraction=float("inf")), "max_native_fraction=inf"),
        (lambda: SourceAttention(reduce="mean"), "reduce='mean'"),
        (lambda: SourceAttention(recent=0), "recent=0"),
        (lambda: SourceAttention(after=-1), "after=-1"),
        (lambda: KeyDeviation(check_layer=-1), "check_layer=-1"),
    ],
)
def test_a_field_out_of_bounds_is_a_value_error_naming_it(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_right_values_pass_and_int_likes_become_ints():
    config = HandoffConfig(native_head=np.int64(2), native_tail=torch.tensor(1).item(), native_layers=[1, 0])
    assert config.native_head == 2 and type(config.native_head) is int and config.native_layers == (1, 0)
    assert HandoffConfig(native_layers="all", key_norm=False, one_launch=None).key_norm is False
    assert QualityPolicy(min_quality=-0.5).min_quality == -0.5  # R^2 may be negative
    assert HandoffConfig().replace(native_tail=2).native_tail == 2
    with pytest.raises(TypeError, match="key_norm='yes'"):
        HandoffConfig().replace(key_norm="yes")  # replace validates again


def test_check_config():
    assert check_config(None) == HandoffConfig()
    config = HandoffConfig(native_tail=1)
    assert check_config(config) is config
    with pytest.raises(
        TypeError, match=r"config is a dict; expected a bridgecache HandoffConfig.*\*\*options"
    ):
        check_config({"refresh": None})
    with pytest.raises(TypeError, match=r"config is a RefreshConfig.*HandoffConfig\(refresh=\.\.\.\)"):
        check_config(RefreshConfig())
    with pytest.raises(TypeError, match="config is a str"):
        check_config("default")


def test_check_contexts_refuses_one_str_and_bad_items():
    assert check_contexts(["a", "b c"]) == ["a", "b c"]
    assert check_contexts(("a",)) == ["a"]
    with pytest.raises(TypeError, match=r"contexts is a str \(8 characters\); expected a list of texts"):
        check_contexts("one text")
    with pytest.raises(TypeError, match="contexts is a bytes"):
        check_contexts(b"one text")
    with pytest.raises(ValueError, match="contexts is empty"):
        check_contexts([])
    with pytest.raises(TypeError, match=r"contexts\[1\] is a int; expected a str"):
        check_contexts(["a", 3])
    with pytest.raises(ValueError, match=r"contexts\[0\] is empty"):
        check_contexts(["", "b"])
    with pytest.raises(TypeError, match="contexts is a generator"):
        check_contexts(t for t in ["a"])
    with pytest.raises(TypeError, match="contexts is a dict"):
        check_contexts({"a": 1})


def test_check_text():
    assert check_text("q?", "prompt") == "q?"
    assert check_text("", "prompt", allow_empty=True) == ""
    with pytest.raises(ValueError, match="prompt is empty"):
        check_text("", "prompt")
    with pytest.raises(TypeError, match="prompt is a list; expected a str"):
        check_text(["q"], "prompt")
    with pytest.raises(TypeError, match="context is a NoneType"):
        check_text(None, "context")


def test_check_messages():
    chat = [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]
    assert check_messages(chat) == chat and check_messages(chat) is not chat  # a copy, never the caller's
    for bad, message in [
        ("hi", "messages is a str"),
        ({"role": "user", "content": "hi"}, "messages is a dict"),
        ([], "messages is empty"),
        (["hi"], r"messages\[0\] is a str; expected a dict"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] is a NoneType"),
        ([{"role": 1, "content": "x"}], r"messages\[0\]\['role'\] is a int"),
        ([{"role": "", "content": "x"}], r"messages\[0\] has an empty 'role'"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            check_messages(bad)


def test_check_fits_names_both_numbers():
    assert check_fits(512, 512, "the context") == 512
    assert check_fits(10**7, None, "the context") == 10**7  # no window stated
    with pytest.raises(ValueError, match="the context is 513 tokens; the model reads at most 512"):
        check_fits(513, 512, "the context")
    with pytest.raises(TypeError, match="expected an int >= 0"):
        check_fits(-1, 512, "the context")
