"""The records mtpquant writes into a checkpoint and reads back: the validation report (``validation``: report.json,
with its acceptance records, ``acceptance``, and intervals, ``evidence``), the speculation profile (``profile``), the
provenance file (``provenance``), and the acceptance table every text form shares (``table``).

Below the commands: validate writes the report, publish's card reads it, graft and heal know where it lives.
"""
