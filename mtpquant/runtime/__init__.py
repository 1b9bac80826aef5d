"""Where and how a run computes: ``machine`` (RAM, GPU memory, CPU cores, the device, OpenMP's settings),
``memory`` (the placement plan under ``--max-memory`` and the allocator's settings), ``meter`` (step timers, peak
RSS), ``libraries`` (importing torch / transformers / modelopt, and their output through logging).
"""
