"""The simulator: the engine's own programs timed under a cost model, without devices.

``simulator`` (discrete-event timing of the lowered programs through ``core.program.interpreter``), ``cost``
(the cost model), ``programs`` (PACI's, DeepSpeed's and the peers' programs), ``peer_schedules`` (torch's action
lists), ``tied`` (the tied exchange added), ``links`` (a fitted link model), ``records`` (per-action records, the
format traces share), ``render`` and ``timeline`` (pictures), ``simulate`` (the command line and the public names).
``python -m ds_paci.tools.sim`` (= ``python -m ds_paci.tools.sim.simulate``).
"""
