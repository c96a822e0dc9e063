"""Measuring tools, on top of the engine and the workload: one layer, folders by what they measure.

``sim`` (the simulator and trace pictures), ``replay`` (the engine's semantics in one process), ``bench`` (the
side-by-side benchmark), ``studies`` (peers, quality, scale, soak, savekill: one entry each) and ``processes``
(launching and worlds of real ranks, shared with the tests).
"""
