"""Quantization recipes: the shipped YAML files beside this module, and ``recipe`` (the validated recipe model,
loading, ``--set`` overrides, the recipe written into an output).
"""
