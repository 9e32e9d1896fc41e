"""Device code every Numba kernel family shares: the intrinsics (one module per PTX family),
float32 constants, 16-bit bit helpers, cp.async tile copies, the backward's delta kernel, and
the scalar rules of attention that every kernel applies inside its own loops:

  mask.py         which keys a query sees (the element predicate)
  block_range.py  which key tiles a query tile visits, which query tiles a key tile visits,
                  and each visited tile's class (partial: masked per element; full: not)
  softmax.py      the online-softmax update, the epilogue, P from the saved lse, and dS

A kernel factory gets these from factories keyed on the call's AttentionSpec (for_kernels()),
so the rules fold into each kernel as constants.
"""
