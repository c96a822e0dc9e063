"""The README's Megatron-DeepSpeed commands, copied out of README.md and run as written (issue 29).

The block in the README's "Megatron-DeepSpeed" section that runs ``python -m ds_paci.integrations.megatron
prepare`` is taken line by line (continuations joined, comments dropped) and run by ``bash`` from the repository
root, with ``MEGATRON_ITERS`` (the README's documented knob) shortening the run and ``MASTER_PORT`` set to a free
port. One line is not run: ``pip install -e '.[megatron-test]'``, which ``make test`` (and ``make megatron``) has
run already through the Makefile's ``$(MEGATRON_STAMP)``; re-running it from a test would reinstall the package
under test into the venv. The test checks instead that its packages import (``prepare`` checks the rest).

PACI ran when: the commands exit 0; Megatron printed one iteration line per iteration with a loss and no skipped
or NaN iteration; and the checkpoint Megatron saved at the end is the PACI engine's (its atomic save writes
``ds_paci_manifest.json``, DeepSpeed's own save does not).

``make megatron`` runs ``launch/megatron_cpu/run.sh``: the same commands without the install line, checked here too.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from ds_paci.integrations import megatron
from harness import REPO_ROOT as ROOT, free_port

# one xdist worker with tests/megatron/test_megatron_gpt.py: both extract into and run from .cache/megatron
pytestmark = pytest.mark.xdist_group("megatron")

README = ROOT / "README.md"
RUN_SH = ROOT / "launch" / "megatron_cpu" / "run.sh"
INSTALL = "pip install -e '.[megatron-test]'"
ITERS = 4  # MEGATRON_ITERS: the README's default is 20
CHECKPOINTS = ROOT / ".cache" / "megatron" / "runs" / "gpt-paci"  # the README's --save folder
TIMEOUT_S = 600


def commands(text):
    """Shell commands of a block: comments dropped, backslash continuations joined, blank lines skipped."""
    out, pending = [], ""
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#\s.*$", "", raw).rstrip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        out.append(re.sub(r"\s+", " ", (pending + line).strip()))
        pending = ""
    assert not pending, f"unfinished continuation: {pending}"
    return out


def readme_block():
    """The README's Megatron block (the one that runs ``prepare``), as commands."""
    text = README.read_text()
    section = re.search(r"^## Megatron-DeepSpeed\n(.*?)(?=^## )", text, re.M | re.S)
    assert section, "README has no '## Megatron-DeepSpeed' section"
    blocks = [b for b in re.findall(r"^```bash\n(.*?)^```", section.group(1), re.M | re.S)
              if "ds_paci.integrations.megatron prepare" in b]
    assert len(blocks) == 1, f"expected one bash block running prepare in the Megatron section, found {len(blocks)}"
    return commands(blocks[0])


def test_make_megatron_runs_the_readmes_commands():
    readme = readme_block()
    assert INSTALL in readme, f"the README's block should install the extra with `{INSTALL}`"
    script = RUN_SH.read_text()
    assert "# --- README commands ---" in script
    ran = commands(script.split("# --- README commands ---", 1)[1])
    assert ran == [c for c in readme if c != INSTALL]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^megatron: \$\(MEGATRON_STAMP\)\n\tbash launch/megatron_cpu/run\.sh$", makefile, re.M)


def test_the_command_parser_joins_continuations_and_drops_comments():
    assert commands("a b \\\n   c   # note\n# whole line\n\nd 'x#y'\n") == ["a b c", "d 'x#y'"]


@pytest.mark.process
def test_the_readmes_megatron_commands_run_pretrain_gpt_on_paci():
    lines = readme_block()
    if not (ROOT / ".venv" / "bin" / "activate").is_file():
        pytest.fail("the README's commands start with `source .venv/bin/activate`: run `make setup` first "
                    "(`make test` does)", pytrace=False)
    absent = [name for name in megatron.MEGATRON_PACKAGES if megatron._missing(name)]
    if absent:
        pytest.fail(f"{absent} missing: `{INSTALL}` (run by `make test`) has not run", pytrace=False)
    shutil.rmtree(CHECKPOINTS, ignore_errors=True)  # the README's --save folder: this run's checkpoint only
    script = "set -euo pipefail\n" + "\n".join(c for c in lines if c != INSTALL) + "\n"
    env = dict(os.environ, MEGATRON_ITERS=str(ITERS), MASTER_PORT=str(free_port()))
    try:
        proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the README's Megatron commands ran past {TIMEOUT_S} s:\n{str(e.stdout)[-4000:]}")
    output = proc.stdout
    assert proc.returncode == 0, f"the README's Megatron commands failed (rc {proc.returncode}):\n{output[-6000:]}"
    log = megatron.parse_log(output)
    assert sorted(log.iterations) == list(range(1, ITERS + 1)), (sorted(log.iterations), output[-3000:])
    for i, fields in log.iterations.items():
        assert "lm loss" in fields and fields.get("number of skipped iterations") == 0, (i, fields)
        assert fields.get("number of nan iterations") == 0, (i, fields)
    assert "final" in log.validation, output[-3000:]
    tag = CHECKPOINTS / f"global_step{ITERS}"
    assert (tag / "mp_rank_00_model_states.pt").is_file(), f"no checkpoint {tag}"
    assert (tag / "ds_paci_manifest.json").is_file(), f"{tag} was not saved by the PACI engine (no manifest)"
    assert re.search(r"ds_paci: PACI on \(async\), 2 stages", output), output[-3000:]
    print(f"README Megatron commands: {ITERS} iterations on PACI, rc 0, checkpoint {tag}", file=sys.stderr)
