"""The replay: every stage's PACI stream in one process with the engine's semantics, bit-identical to the engine.

``replayer`` (the replay and its command line) and ``check`` (the same run on real engines and in the replay,
compared). ``python -m ds_paci.tools.replay`` (= ``python -m ds_paci.tools.replay.replayer``).
"""
