"""The text models are fed: ``corpus`` (the offline text shipped with CPython), ``calibration`` (calibration rows
for convert and heal, the tokenizer), ``prompts`` (validate's prompts, held-out documents, sequence plans).
"""
