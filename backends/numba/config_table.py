"""Per-head-dim config tables of the kernel families: rows of (max head_dim, entry)."""


def lookup(table, head_dim):
    """The config of the first row of (max head_dim, config) that covers head_dim, or None."""
    for max_head_dim, config in table:
        if head_dim <= max_head_dim:
            return config
    return None


def pick(table, head_dim):
    config = lookup(table, head_dim)
    if config is None:
        raise ValueError(f"headdim must be <= {table[-1][0]}; got {head_dim}")
    return config
