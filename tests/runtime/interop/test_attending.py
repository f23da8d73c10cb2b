"""Our attention reaches a view's layers through a context variable, and nothing else.

The native-work pass and the reading hand their mask to bridgecache's attention function with
`attending(mask)`, not as a forward keyword: StableLM's and Nemotron's decoder layers call their
attention without handing keywords on. The mask must reach exactly the forwards inside the block,
in the thread that runs it: never the user's model, another thread, or a forward after it.
"""

from __future__ import annotations

import threading

import pytest
import torch
from tiny_models import tiny_architecture

from bridgecache.runtime.interop.attention import NAME, attending
from bridgecache.runtime.interop.views import ModelView


class Tripwire:
    """A mask whose attention counts its calls and returns the queries (wrong on purpose)."""

    def __init__(self):
        self.calls = 0

    def attend(self, module, query, key, value, scaling):
        self.calls += 1
        return query.transpose(1, 2)


@pytest.mark.parametrize("name", ["stablelm", "nemotron", "qwen3"])
def test_the_mask_reaches_the_views_layers_inside_the_block_only_and_in_its_thread_only(name):
    model = tiny_architecture(name)
    view = ModelView(model, NAME)
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        trip = Tripwire()
        elsewhere = {}

        def other_thread():
            elsewhere["view"] = view.model(input_ids=ids).logits

        with attending(trip):
            ours = view.model(input_ids=ids).logits
            assert trip.calls == model.config.num_hidden_layers  # every layer, keywords dropped or not
            assert not torch.allclose(ours, own, atol=1e-3)  # the tripwire's attention ran
            user = model(input_ids=ids).logits  # the user's own model: its own attention
            thread = threading.Thread(target=other_thread)
            thread.start()
            thread.join()
        after = view.model(input_ids=ids).logits
    assert trip.calls == model.config.num_hidden_layers
    assert torch.equal(user, own)
    assert torch.allclose(elsewhere["view"], own, atol=1e-5)  # the view in another thread: its own attention
    assert torch.allclose(after, own, atol=1e-5)
