"""Atomic checkpoints for any DeepSpeed engine, on shared or node-local disks.

``atomic`` (staging folder, manifest, ``latest`` moved last; the public save/load/resume functions), ``files``
(the folder's vocabulary), ``disks`` (which ranks share a disk; files a disk lacks) and ``choice`` (which folder
every rank loads). Imports the seam and ``health.nodes``.
"""
