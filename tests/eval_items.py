"""Evaluation items a tiny random model can answer only from their context: each continuation (or
right answer) is the model's own greedy continuation of the context (tests/evaluation)."""

from __future__ import annotations

import math
import string

import torch

from bridgecache.evaluation import ChoiceItem, PplItem

VOCAB = 258  # 256 bytes + <s> + </s>


LETTERS = string.ascii_lowercase + " "


@torch.no_grad()
def greedy(model, tok, text: str, n: int, alphabet: str = LETTERS) -> str:
    """The model's greedy continuation of `text`, restricted to `alphabet` (lowercase letters and
    space by default, so the text round-trips through the tokenizer exactly)."""
    ids = tok(text, return_tensors="pt")["input_ids"]
    allowed = torch.full((VOCAB,), -math.inf)
    allowed[[tok(c, add_special_tokens=False)["input_ids"][0] for c in alphabet]] = 0
    out = []
    for _ in range(n):
        nxt = int((model(ids).logits[0, -1] + allowed).argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tok.decode(out)


def contexts(n: int, chars: int, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    letters = string.ascii_lowercase + "     "
    return [
        "".join(letters[int(i)] for i in torch.randint(len(letters), (chars,), generator=g)) for _ in range(n)
    ]


def ppl_items(model, tok, n=3, chars=40) -> list[PplItem]:
    return [PplItem(c, greedy(model, tok, c, 12)) for c in contexts(n, chars)]


def choice_items(model, tok, n=3, chars=40) -> list[ChoiceItem]:
    items = []
    for k, context in enumerate(contexts(n, chars, seed=1)):
        question = "what next"
        right = greedy(model, tok, f"{context}\nQuestion: {question}\nAnswer: ", 6, string.ascii_lowercase)
        wrong = [w for w in ("zq xv", "kkk jj", "wpw") if w != right][:2]
        choices = [right, *wrong] if k % 2 == 0 else [*wrong, right]
        items.append(ChoiceItem(context, question, tuple(choices), choices.index(right)))
    return items
