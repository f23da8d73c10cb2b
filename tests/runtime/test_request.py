"""HandoffRequest.from_chat: the one way a chat becomes a request, for Conversation and for the
evaluation's chat mode (tiny models, byte tokenizers with chat templates; no download)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import CHATML, ZEPHYR, chat_tokenizer, tiny_model

from bridgecache.bridge.maps import Bridge
from bridgecache.evaluation.prompts import Prompts
from bridgecache.runtime.entry.conversation import Conversation
from bridgecache.runtime.request import HandoffRequest

pytestmark = pytest.mark.usefixtures("one_thread")

MESSAGES = [{"role": "user", "content": "The Alder lost its mast near the rocks; the Heron towed it in."}]


def _bridge():
    return Bridge.identity(tiny_model("qwen2", max_position_embeddings=4096))


def test_one_tokenizer_and_one_template_read_one_rendering():
    tok = chat_tokenizer(CHATML)
    request = HandoffRequest.from_chat(_bridge(), MESSAGES, tok, tok, words=True)
    assert request.alignment is None and request.source_ids is request.target_ids
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert request.target_ids[0].tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert torch.equal(request.words.source, request.words.target)
    assert request.source_prompt is None and request.source_kv is None


def test_other_templates_are_aligned_even_over_one_vocabulary():
    source, target = chat_tokenizer(ZEPHYR), chat_tokenizer(CHATML)  # same bytes, other templates
    request = HandoffRequest.from_chat(_bridge(), MESSAGES, source, target)
    assert request.alignment is not None
    assert request.source_ids.shape != request.target_ids.shape  # each model reads its own template
    assert request.words is None


def test_conversation_and_evaluation_read_a_chat_as_from_chat_does():
    source, target = chat_tokenizer(ZEPHYR), chat_tokenizer(CHATML, "<extra>")
    model = tiny_model("qwen2", max_position_embeddings=4096, vocab_size=300)
    bridge = Bridge.identity(model)
    expected = HandoffRequest.from_chat(bridge, MESSAGES, source, target, words=True)
    context = Prompts(source, target, chat=True).context(MESSAGES[0]["content"], bridge, words=True)
    assert torch.equal(context.source_ids, expected.source_ids)
    assert torch.equal(context.target_ids, expected.target_ids)
    assert torch.equal(context.words.target, expected.words.target)
    chat = Conversation.handoff(
        bridge, model, model, MESSAGES, source_tokenizer=source, target_tokenizer=target
    )
    assert torch.equal(chat.ids.cpu(), expected.target_ids)
    assert torch.equal(chat._handoff.request.source_ids, expected.source_ids)
