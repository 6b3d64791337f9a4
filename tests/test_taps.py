"""How a tap's tensor is taken from what a hook sees, on either side."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vllm_parity.harness.taps import take_for


@given(heads=st.integers(1, 6), groups=st.integers(1, 3), head_dim=st.sampled_from([1, 2, 4, 8]),
       tokens=st.integers(1, 5))
def test_the_q_k_v_slices_of_a_fused_projection_rebuild_it(heads, groups, head_dim, tokens):
    kv = max(1, heads // groups)
    config = SimpleNamespace(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv,
                             head_dim=head_dim)
    fused = torch.randn(1, tokens, (heads + 2 * kv) * head_dim)
    q, k, v = (take_for(f"qkv.{j}", config)(fused, None) for j in range(3))
    assert q.shape[-1] == heads * head_dim and k.shape[-1] == v.shape[-1] == kv * head_dim
    assert torch.equal(torch.cat([q, k, v], dim=-1), fused)
    gate, up = (take_for(f"halves.{j}", config)(fused[..., : 2 * head_dim], None) for j in range(2))
    assert torch.equal(torch.cat([gate, up], dim=-1), fused[..., : 2 * head_dim])


@given(heads=st.integers(1, 4), head_dim=st.integers(1, 6), tokens=st.integers(1, 5))
def test_per_head_norms_flatten_alike_on_both_layouts(heads, head_dim, tokens):
    """transformers' [batch, tokens, heads, d] or [batch, heads, tokens, d] and vLLM's [tokens, heads, d]
    give the same [.., tokens, heads * d] rows."""
    vllm = torch.randn(tokens, heads, head_dim)
    token_major, head_major = vllm.unsqueeze(0), vllm.transpose(0, 1).unsqueeze(0)
    flat = take_for("heads_flat", None)(vllm, None)
    assert flat.shape == (tokens, heads * head_dim)
    assert torch.equal(take_for("heads_flat", None)(token_major, None)[0], flat)
    assert torch.equal(take_for("heads_first_flat", None)(head_major, None)[0], flat)


def test_scaled_embeddings_and_an_unknown_take():
    x = torch.ones(2, 16)
    assert torch.equal(take_for("times_sqrt_width", None)(x, None), torch.full((2, 16), 4.0))
    assert torch.equal(take_for("times_scale_emb", SimpleNamespace(scale_emb=12))(x, None), torch.full((2, 16), 12.0))
    with pytest.raises(KeyError, match=r"no take 'sideways'; the takes are \[.*'first'.*'qkv\.0'"):
        take_for("sideways", None)
