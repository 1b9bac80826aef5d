"""The MTP precision search (``convert --mtp auto``, ``tune-mtp``): the smallest MTP whose predicted acceptance stays
within a budget of the BF16 MTP's on the same quantized target.

- ``space``: configurations (a precision per precision group of the family), their tensors and bytes from headers,
  which of them the engines load and how the output declares them (torch-free).
"""
