"""A run's health across processes and nodes.

``watchdog`` (a rank stuck in one instruction says where and exits), ``liveness`` (the peer watch across nodes),
``lifecycle`` (clean stops on signals and launcher death) and ``nodes`` (which node a rank is on). Imports
nothing else of the package.
"""
