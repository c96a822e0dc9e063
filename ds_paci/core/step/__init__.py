"""A stage's local optimizer step.

``local_step`` (the stage-local MPU view, ``.data`` aliases, clipping by the stage's own norm, the guarded step),
``guard`` (the non-finite guard's bookkeeping and refusal to save non-finite weights) and ``window_state`` (the
open accumulation window as data, for checkpoints). Imports only the seam.
"""
