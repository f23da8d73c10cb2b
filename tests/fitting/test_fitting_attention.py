"""Attention-aligned token weights against a brute-force computation from full attention matrices."""

from __future__ import annotations

import importlib

import pytest
import torch
from tiny_models import FAMILIES, tiny_model

from bridgecache.fitting.attention import QueryRecorder, attention_modules, boundary_rows, layer_weights
from bridgecache.kv.capture import capture_kv
from bridgecache.kv.rope import RopeTables


def test_boundary_rows_are_log_spaced_and_skip_native_head():
    rows = boundary_rows(256, 32, first=1)
    assert rows[0] == 1 and rows[-1] == 255 and len(rows) <= 32
    assert torch.all(rows[1:] > rows[:-1])
    gaps = rows[1:] - rows[:-1]
    assert gaps[-1] > gaps[0]  # denser near the start
    assert boundary_rows(3, 32, first=1).tolist() == [1, 2]


@pytest.mark.parametrize("family", FAMILIES)
def test_token_weights_match_brute_force(family):
    model = tiny_model(family)  # eager attention, so full attention matrices can be returned
    ids = torch.randint(0, 320, (2, 21), generator=torch.Generator().manual_seed(0))
    rows = boundary_rows(21, 6, first=1)  # [1, 2, 4, 7, 12, 20]: gemma3's window of 8 masks early keys
    modeling = importlib.import_module(type(model).__module__)

    # Brute force: full [tokens, tokens] attention from transformers, q from q_proj (+ q_norm) and
    # transformers' own RoPE, o_u from the input of o_proj.
    q_raw, o_in, handles = {}, {}, []
    for module in attention_modules(model):
        i = module.layer_idx
        handles.append(module.q_proj.register_forward_hook(lambda m, a, out, i=i: q_raw.__setitem__(i, out)))
        handles.append(module.o_proj.register_forward_pre_hook(lambda m, a, i=i: o_in.__setitem__(i, a[0])))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
        tables, position_ids = RopeTables.from_model(model), torch.arange(21)[None].expand(2, -1)
        pos_emb = {m.layer_idx: tables.cos_sin(m.layer_idx, position_ids) for m in attention_modules(model)}
    for h in handles:
        h.remove()
    captured = capture_kv(model, ids)

    with QueryRecorder(model, rows) as recorder:
        captured_again = capture_kv(model, ids)
    r_keys, r_values = layer_weights(model, recorder, captured_again.keys, captured_again.values)

    for module in attention_modules(model):
        layer, d = module.layer_idx, module.head_dim
        attn = out.attentions[layer]  # [batch, q_heads, tokens, tokens]
        hq, hkv = attn.shape[1], captured.values[layer].shape[1]
        q = q_raw[layer].view(2, 21, hq, d).transpose(1, 2)
        if getattr(module, "q_norm", None) is not None:
            with torch.no_grad():
                q = module.q_norm(q)
        cos, sin = pos_emb[layer]
        q, _ = modeling.apply_rotary_pos_emb(q, q, cos, sin)
        o = o_in[layer].view(2, 21, hq, d).transpose(1, 2)
        v = captured.values[layer]
        want_k = torch.zeros(2, hkv, 21)
        want_v = torch.zeros(2, hkv, 21)
        for b in range(2):
            for head in range(hq):
                kv = head // (hq // hkv)
                for u in rows.tolist():
                    for i in range(21):
                        a = float(attn[b, head, u, i])
                        want_v[b, kv, i] += a * a
                        dist = float(((v[b, kv, i] - o[b, head, u]) ** 2).sum())
                        qn = float((q[b, head, u] ** 2).sum()) * module.scaling**2
                        want_k[b, kv, i] += a * a * dist * qn
        torch.testing.assert_close(r_values[layer], want_v, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(r_keys[layer], want_k, rtol=1e-4, atol=1e-6)
        assert torch.all(r_values[layer] > 0) and torch.all(r_keys[layer] > 0)
