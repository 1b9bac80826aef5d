"""The network: ``http`` (bounded HTTP reads: deadlines, byte caps), ``hub`` (huggingface_hub's transport, its
errors as one line, ranged reads), ``safejson`` (JSON parsed without recursion past the parser's depth).
"""
