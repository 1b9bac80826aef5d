"""``graft``: put a lost MTP back into an existing quant, writing only the MTP bytes (``run.graft``), or repair
its MTP metadata alone (``run.fix_metadata``). ``lineage`` checks SRC fits QUANT; ``inplace`` swaps a directory
atomically.
"""
