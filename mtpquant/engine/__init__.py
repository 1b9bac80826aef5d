"""Serving engines (vLLM, SGLang, TensorRT-LLM): what they do with a checkpoint, and mtpquant talking to them (over
HTTP, never by import).

- ``table``: the engines, one row each (``Engine``): every module that names an engine reads it;
- one module per engine, its *adapter*: ``vllm``, ``sglang`` (``trtllm``): the engine's loading rules (how it builds
  each module of a checkpoint, its verdict line and serve command for inspect) and its client (a running server,
  measured by its own speculative counters);
- ``loading``: the loading rules the engines share (module grouping, ModelOpt / compressed-tensors exclusions,
  MIXED_PRECISION resolution) and ``mtp_load_refusal``; ``verdicts``: the verdicts no engine decides alone and the
  facts every engine's is drawn from;
- ``connect``: which engine serves at a URL (each engine's ``probe``, in the table's order) and its client;
- ``server``: what every client returns (``ServerInfo``, ``Completion``, ``DraftCounts``, ``EngineRun``) and the
  ``EngineServer`` protocol; ``http``: the one HTTP transport every client uses; ``counters``: Prometheus text;
- ``launch``: start a server from its own Python environment on 127.0.0.1, and stop it again; ``sizing``: the memory
  such a server gets, from the checkpoint and what validate sends.
"""
