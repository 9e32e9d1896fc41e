"""torch FlexAttention as a peer of scripts/bench_variants.py's rows: each row's mask and score
mods written as FlexAttention's `mask_mod` / `score_mod`, so that both compute the same
attention (tests/variants/test_flex_peer.py checks that against numba_flash's reference).

Rows are square (seqlen_q = seqlen_k), where numba_flash's bottom-right causal alignment is
FlexAttention's top-left one; varlen's documents become a document mask over the packed
sequence, causal within each document.
"""


def flex_attention_call(torch, options, seqlen, device, alibi_slopes=None, lengths=None,
                        compile=True):
    """fn(q, k, v) -> out for (batch, heads, seqlen, head_dim) tensors: FlexAttention with the
    row's options (numba_flash.forward's causal, window_size, softcap; alibi_slopes a (heads,)
    tensor; lengths the packed documents of a varlen row). With compile, torch.compile'd (as
    FlexAttention is meant to run)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    causal = options.get("causal", False)
    left, right = options.get("window_size", (-1, -1))
    right = 0 if causal else right
    softcap = float(options.get("softcap", 0.0))
    document = None
    if lengths is not None:
        document = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                           torch.tensor(lengths, device=device))

    def mask_mod(b, h, q_idx, kv_idx):
        seen = q_idx >= 0  # (a tensor of True of the indices' shape)
        if right >= 0:
            seen = seen & (kv_idx <= q_idx + right)
        if left >= 0:
            seen = seen & (kv_idx >= q_idx - left)
        if document is not None:
            seen = seen & (document[q_idx] == document[kv_idx])
        return seen

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap:
            score = softcap * torch.tanh(score / softcap)
        if alibi_slopes is not None:
            score = score - alibi_slopes[h] * (q_idx - kv_idx).abs()
        return score

    masked = right >= 0 or left >= 0 or document is not None
    block_mask = (create_block_mask(mask_mod, None, None, seqlen, seqlen, device=device)
                  if masked else None)
    modded = softcap or alibi_slopes is not None
    attend = torch.compile(flex_attention) if compile else flex_attention

    def call(q, k, v):
        return attend(q, k, v, score_mod=score_mod if modded else None, block_mask=block_mask,
                      enable_gqa=q.shape[1] != k.shape[1])
    return call
