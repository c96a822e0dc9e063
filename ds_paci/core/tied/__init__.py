"""Tied layers on several stages.

``weights`` (``TiedWeights``: the exchange of window gradients between owners), ``layout`` (which stages own tied
layers, the arrangements refused), ``transport`` (one window's messages in an order NCCL cannot deadlock on) and
``optimizer`` (a tied owner's optimizer step on every optimizer path). Imports the program, the seam and the step.
"""
