"""Issue 30's candidates (``ds_paci.tools.replay.candidates``) on the hard cells, in the replay: ``study`` (cells,
candidates, running them resumably, one JSON file per run) and ``python -m ds_paci.tools.studies.candidates``."""
