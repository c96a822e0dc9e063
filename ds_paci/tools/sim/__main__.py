"""``python -m ds_paci.tools.sim``: the simulator's comparison table (see :mod:`.simulate`)."""
from .simulate import main

main()
