"""`import rtckern.torch`: the PyTorch plugin (rtckern.plugins.torch) under a short name.

Importing it registers torch.ops.rtckern.*; see rtckern.plugins.torch for the API.
"""
from rtckern.plugins.torch import *  # noqa: F401,F403
from rtckern.plugins.torch import __all__  # noqa: F401
