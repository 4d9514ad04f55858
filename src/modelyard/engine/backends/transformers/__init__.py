"""The in-process transformers backend: the only package of modelyard that imports torch.

Its modules import torch and transformers lazily or at their top; this file imports nothing, so
that reading a submodule's pure parts (params, precision) stays cheap.
"""
