"""Serving engines as mtpquant talks to them: over HTTP, never by import.

- ``counters``: vLLM's speculative-decoding counters from ``/metrics`` (Prometheus text), and their deltas;
- ``client``: a running OpenAI-compatible server (``/version``, ``/v1/models``, ``/v1/completions``, ``/metrics``);
- ``launch``: start a vLLM OpenAI server from a separate Python environment on 127.0.0.1 and stop it again.
"""
