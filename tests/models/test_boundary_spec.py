"""model_spec, the first thing every entry asks of a model, refuses what is not a model, a
config or a tokenizer by name (bridgecache.checks), not with an AttributeError from inside."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model

from bridgecache import model_spec
from bridgecache.checks import FieldTypeError


def test_model_spec_refuses_what_is_not_a_model_or_config():
    for bad in (None, "qwen2", 3):
        with pytest.raises(FieldTypeError, match="expected a transformers model or its config"):
            model_spec(bad)
    with pytest.raises(FieldTypeError, match="tokenizer=3; expected a transformers tokenizer"):
        model_spec(tiny_model("qwen2"), 3)
