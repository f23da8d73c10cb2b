"""bridgecache.checks, the boundary's primitives: each names the argument, shows the value (cut,
escaped) and says what was expected; a wrong type is a FieldTypeError (TypeError and ValueError),
a wrong value a ValueError, an object made for another a MismatchError."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import byte_tokenizer, tiny_model

import bridgecache.checks as checks
from bridgecache.checks import FieldTypeError, MismatchError


def test_integer_takes_ints_and_int_like_scalars_only():
    assert checks.integer(np.int64(3), "n", low=0) == 3
    for bad in (True, 2.0, "2", None, float("nan")):
        with pytest.raises(FieldTypeError, match="n="):
            checks.integer(bad, "n")
    with pytest.raises(ValueError, match=r"n=11; expected an int >= 0 <= 10"):
        checks.integer(11, "n", low=0, high=10)


def test_a_huge_value_is_shown_cut_and_escaped():
    with pytest.raises(FieldTypeError) as raised:
        checks.instance("\x1b[31m" + "x" * 10**6, "name", int, "an int")
    message = str(raised.value)
    assert len(message) < 200 and "\\x1b" in message and "\x1b" not in message


def test_model_and_tokenizer_are_recognised_by_what_they_offer():
    model, tok = tiny_model("llama"), byte_tokenizer()
    assert checks.model(model, "m") is model and checks.tokenizer(tok, "t") is tok
    assert checks.model(None, "m", optional=True) is None
    for bad in (model.config, torch.nn.Linear(2, 2), "gpt2", type(model)):
        with pytest.raises(FieldTypeError, match="expected a transformers causal LM"):
            checks.model(bad, "m")
    for bad in (model, "tok", type(tok), len):
        with pytest.raises(FieldTypeError, match="expected a transformers tokenizer"):
            checks.tokenizer(bad, "t")


def test_ids_and_masks():
    ids = torch.tensor([[0, 5, 9]])
    assert checks.ids(ids, "ids", vocab=10, batch=1) is ids
    assert checks.ids(torch.zeros(2, 0, dtype=torch.long), "ids", vocab=10).shape == (2, 0)
    for bad, message in [
        (ids.bool(), "dtype torch.bool"),
        (ids.double(), "dtype torch.float64"),
        (ids[0], r"shape \(3,\)"),
        (ids + 1, "holds the id 10; expected ids in 0..9"),
    ]:
        with pytest.raises(ValueError, match=message):
            checks.ids(bad, "ids", vocab=10)
    with pytest.raises(ValueError, match="ids has 1 rows; expected 2"):
        checks.ids(ids, "ids", batch=2)
    assert checks.mask(None, "mask", ids) is None
    with pytest.raises(ValueError, match=r"mask has shape \(1, 2\); expected \(1, 3\)"):
        checks.mask(torch.ones(1, 2), "mask", ids)
    with pytest.raises(ValueError, match="values other than 0 and 1"):
        checks.mask(torch.tensor([[1.0, float("nan"), 1.0]]), "mask", ids)


def test_layer_indices():
    assert checks.layer_indices((0, np.int32(2)), "rule", 3) == (0, 2)
    assert checks.layer_indices([], "rule", 3) == ()
    for bad, message in [(-1, "gave -1; expected a tuple"), ("01", "gave '01'"), ([3], r"rule\[0\]=3"),
                         ([True], r"rule\[0\]=True"), ([0] * 4, "gave 4 layers")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            checks.layer_indices(bad, "rule", 3)


def test_same_compares_identity_not_equality():
    a, b = [1], [1]
    checks.same(a, a, "engine", "bridge")
    with pytest.raises(
        MismatchError, match=r"engine was built for another bridge \(\[1\]\) than the one given"
    ):
        checks.same(a, b, "engine", "bridge")
