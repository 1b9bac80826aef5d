"""``graft``: put a lost MTP back into an existing quant, writing only the MTP bytes (``run.graft``), or repair
its MTP metadata alone (``run.fix_metadata``); ``source`` reads SRC's MTP bytes, checksummed. The writing itself is
MTP surgery (``mtpquant.surgery``), shared with heal.
"""
