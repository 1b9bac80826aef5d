"""MTP surgery, shared by convert, graft and heal: the modes (``modes``), the deterministic MTP shard layout
(``shards``), the one place that edits the MTP declaration and exclusions (``metadata``, with the repairs
``--fix-metadata`` makes, ``repairs``), so that "extract + graft == keep" is one piece of code read twice; and writing
new MTP bytes into an existing quant: which shards change (``plan``), whether SRC fits QUANT (``lineage``), building
the result beside QUANT and putting it in place (``write``), atomically in place (``inplace``).
"""
