"""The program: what every stage runs, as data.

``actions`` (the vocabulary: ``Action``, ``Kind``, the text form), ``stream`` (PACI streams: one persistent 1F1B
stream per stage, windows, the learning-rate rule, the drift bound), ``passes`` (lowering: sync steps, tied
exchange), ``validate`` (the contract checked on a program), ``interpreter`` (the whole pipeline in one process)
and ``tied_timing`` (the tied exchange's lag, checked by vector clocks). Pure Python: imports neither torch,
DeepSpeed nor any other part of the package.
"""
