"""The built-in measurement engine: what speculative decoding with an MTP accepts, replayed with a checkpoint's own
weights (no engine). validate's built-in path and heal's check both measure through it.

- ``weights``: the dequantizing reader of a checkpoint's tensors; ``emulate``: activation quantization emulated as
  the engines run it (``--activations emulate``); ``load``: the MTP and the target model, built and installed;
- ``capture``: the target's continuations and hidden states for planned sequences; ``hidden``: those saved to and
  read from a file (``--save-hidden`` / ``--hidden``);
- ``rules``: the verification rules as arithmetic; ``replay``: the engines' drafting loop replayed (greedy and the
  sampled walk); ``metrics``: acceptance and agreement arithmetic.

The constants below are torch-free, so the CLI and the options checks use them without importing torch.
"""

from typing import Literal, get_args

# The activation modes of the built-in path (``--activations``): off (dequantized weights, full-precision
# activations) or emulate (the engines' W4A4 activation quantization).
Activations = Literal["off", "emulate"]
ACTIVATION_MODES: tuple[str, ...] = get_args(Activations)

# The ``format`` a hidden-state file's safetensors metadata holds (``--save-hidden`` / ``--hidden``).
HIDDEN_FORMAT = "mtpquant.hidden/1"
