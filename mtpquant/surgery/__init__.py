"""What convert and graft share about the MTP: the modes (``modes``), the deterministic MTP shard layout
(``shards``) and the one place that edits the MTP declaration and exclusions (``metadata``), so that
"extract + graft == keep" is one piece of code read twice.
"""
