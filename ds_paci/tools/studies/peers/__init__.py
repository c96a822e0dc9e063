"""PACI against the strongest peers: torch's synchronous schedules (GPipe, 1F1B, interleaved, ZB-V) and DeepSpeed's
stock engine on the same emulated cells. ``study`` (the command line and the grid's runner), ``worker`` (one rank's
run), ``model`` (the cells' model), ``analysis``, ``simcheck`` (the simulator against the measured rounds), ``plots``
and ``report``. ``python -m ds_paci.tools.studies.peers`` (``make peers``).
"""
