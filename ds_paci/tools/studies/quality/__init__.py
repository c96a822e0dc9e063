"""Quality at any depth and batch size: the depth x batch sweep on the replay, the window rules, the report.

``grid`` (the sweep as data: shapes, model, rules, runs) -> ``sweep`` (running it, resumable) ->
``report`` (tables of ``docs/results/quality.md``); ``python -m ds_paci.tools.studies.quality`` is the command line.
"""
