"""Integrations with programs written for DeepSpeed's own engine (unmodified training scripts, Megatron-DeepSpeed).

They use :mod:`ds_paci.core` and never the measuring tools (:mod:`ds_paci.tools`).
"""
