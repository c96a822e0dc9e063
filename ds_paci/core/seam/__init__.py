"""The DeepSpeed seam: everything of DeepSpeed that is not its public API, behind one package.

``deepspeed_internals`` (every private name and internal field, one named function each), ``compat`` (what
differs between the supported DeepSpeed versions, detected from DeepSpeed's code) and ``collective_guard``
(collectives that would span two stages refused before they are entered). Imports nothing else of the package.
"""
