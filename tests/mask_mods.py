"""mask_mods the kernel tests share (tests/variants, tests/kernels/hopper): Python functions
of (b, h, q_idx, kv_idx), compiled into the kernels, with the tile patterns they exercise."""
import numpy as np

#: documents of 7 to 13 tokens (a packed batch's document ids, as a mask_mod reads them)
DOCUMENTS = np.repeat(np.arange(8, dtype=np.int32), [7, 13, 9, 11, 8, 12, 10, 10])


def document_mask(b, h, q_idx, kv_idx):
    """Queries see the keys of their own document (with causal: the earlier ones)."""
    return DOCUMENTS[q_idx] == DOCUMENTS[kv_idx]


def striped_mask(b, h, q_idx, kv_idx):
    """Key stripes of 16 that depend on the batch entry and head (tiles with no key seen
    inside a row's range), and the first key for every query of even heads."""
    return (kv_idx // 16 + b + h) % 3 != 1 or (kv_idx == 0 and h % 2 == 0)


def gapped_mask(b, h, q_idx, kv_idx):
    """Hides key tile 1 + h of 32 keys from every query (an empty key tile inside each query
    tile's range, another one per head: a kernel that asks with the wrong head of a GQA group
    skips the wrong tile), query tile 1 of 32 rows from every key (an empty query tile inside
    each key tile's range), and the queries from 128 on (a 128-row tile that sees no key)."""
    return kv_idx // 32 != 1 + h and q_idx // 32 != 1 and q_idx < 128
