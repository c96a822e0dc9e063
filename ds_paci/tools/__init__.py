"""Measuring tools, on top of the engine and the workload.

``records`` (trace records) <- ``simulate`` (discrete-event simulation of streams),
``render`` (timeline pictures) <- ``timeline`` (its command line), ``world``
(spawn real processes over gloo, fail fast), ``bench`` (the side-by-side benchmark).
"""
