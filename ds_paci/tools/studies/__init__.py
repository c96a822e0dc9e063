"""Studies: long measurements with an entry each, resumable where they take hours.

``peers`` (PACI against torch's schedules), ``quality`` (the depth x batch sweep on the replay), ``scale`` (the
simulator at P = 16..64 with links), ``soak`` (a long async run's memory and transfers), ``savekill`` (kills during
saves, every resume checked), ``linked`` (PP=2 and PP=2 x DP=2 across an emulated, bandwidth-limited link, next to
the simulator). Each is ``python -m ds_paci.tools.studies.<name>``.
"""
