"""``free_port`` (the one rendezvous-port helper of the tests and tools): a port below the kernel's ephemeral range,
free when returned, drawn independently of the seeded ``random`` module (fresh make test: a rank reached a stranger's
listener on a port the kernel had meanwhile handed to another test's gloo connections)."""

import random
import socket

from ds_paci.tools.processes import world


def test_ports_are_free_below_the_ephemeral_range_and_ignore_the_seeded_random():
    low = world._ephemeral_low()
    draws = []
    for _ in range(2):
        random.seed(0)  # tests and jobs seed the module's generator: ports must not repeat with it
        draws.append([world.free_port() for _ in range(20)])
    assert draws[0] != draws[1]
    for port in draws[0] + draws[1]:
        assert 20000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when returned (nothing here holds it)


def test_a_port_in_use_is_never_returned():
    held = []
    try:
        for _ in range(50):
            s = socket.socket()
            s.bind(("127.0.0.1", world.free_port()))
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert len(taken) == 50 and world.free_port() not in taken
    finally:
        for s in held:
            s.close()
