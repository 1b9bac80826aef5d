"""Serving engines (vLLM, SGLang): what they do with a checkpoint, and mtpquant talking to them (over HTTP, never by
import).

- ``loading``: how vLLM and SGLang resolve a checkpoint's exclusions and formats (their loader code's rules, as data
  and functions); ``verdicts``: what each engine builds for each MTP module, the verdict line, the serve command;

- ``connect``: which engine serves at a URL (vLLM's ``/version``, SGLang's ``/get_server_info``) and its client;
- ``server``: what every client returns (``ServerInfo``, ``Completion``, ``DraftCounts``, ``EngineRun``) and the
  ``EngineServer`` protocol;
- ``vllm``: a running vLLM OpenAI server, measured by its server-wide ``/metrics`` counters (``counters``);
- ``sglang``: a running SGLang server, measured by the counters each ``/generate`` answer carries;
- ``http``: the one HTTP transport both clients use; ``sampling``: the sampling settings, spelled per engine;
- ``launch``: start a vLLM or SGLang server from its own Python environment on 127.0.0.1, and stop it again;
  ``sizing``: the memory such a server gets, from the checkpoint and what validate sends.
"""
