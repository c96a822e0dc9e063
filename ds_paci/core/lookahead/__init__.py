"""The window-informed look-ahead: forwards that cross a local step see a prediction of the next weights.

``predict`` (plan, write, run the forward, restore exactly), ``rules`` (each supported optimizer's next step) and
``slots`` (where the look-ahead's tensors live on each optimizer path). Imports the seam and the step.
"""
