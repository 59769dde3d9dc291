"""Framework plugins: `torch` (custom ops under torch.ops.rtckern, drop-in modules, model patching; also
importable as `rtckern.torch`) and `cupy` (the ops on CuPy and other CUDA arrays without torch).

Nothing is imported here: each plugin imports its framework only when it is imported itself.
"""
