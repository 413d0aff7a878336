"""How `make test` hands out its work to the xdist workers: the longest first.

pytest-xdist's --dist loadfile sends a file's tests to one worker, files in the order of
their number of tests: the few long pipeline and server files came last, and one of them
alone made the run's tail. conftest.py imports the hook below.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

# Minutes each long file's tests took in a row (2 workers on a 2-core machine that others
# were using too: the ranking counts, not the values; the first user of
# `reproduced_pipeline`, test_pipeline.py, counts its build). `make test` (--dist loadfile)
# hands its workers the longest work first, so that no long file starts last and makes the
# tail alone; a file not listed is short. test_tune.py, test_tune_shared.py and
# test_team_stack.py: scaled by their changed tests' before/after ratios (issue 40; run side by
# side, one worker, for the tune files; the team stack's one experiment each instead of two,
# estimated).
FILE_MINUTES = {
    "test_pipeline.py": 20,
    "test_tune.py": 15,
    "test_resume.py": 12,
    "test_pipeline_folder.py": 9,
    "test_server_outage.py": 8,
    "test_tracking_server.py": 6,
    "test_bento.py": 6,
    "test_team_stack.py": 5.5,
    "test_sweep.py": 5,
    "test_tune_shared.py": 4.8,
    "test_team.py": 4,
    "test_serving.py": 4,
    "test_interrupt.py": 3,
    "test_promote.py": 3,
    "test_registry_race.py": 3,
    "test_multinode.py": 3,
    "test_quantize.py": 3,
    "test_bench_recipe.py": 2.5,
    "test_ui_browser.py": 2,
    "test_recipe.py": 2,
    "test_client.py": 1.5,
    "test_label_loop.py": 1.2,  # a real Label Studio: its first start migrates a database
    "test_evaluation.py": 1.2,
    "test_backbones.py": 1.2,
    "test_serving_drain.py": 1,
    # 36 CPU-s, 62 s alone on one worker of a shared machine (issue 40): not the 7.5 min
    # a loaded run once showed (it compiles the cnn and the resnet), still split.
    "test_host_syncs.py": 1,
    "test_report.py": 1,
}
# Long files whose tests share nothing costly (no expensive module fixture): their tests go
# out one by one at their file's rank, so that both workers take a share of the file.
SPLIT_FILES = frozenset({"test_tune.py", "test_host_syncs.py"})
# Long tests that share nothing with the rest of their file (each copies the reproduced
# pipeline for itself): each goes out alone, at its own rank (minutes).
SEPARATE_TESTS = {
    "test_pipeline.py::test_dvc_repro_predict_scores_a_folder_with_its_lineage_and_run": 11,
    "test_pipeline.py::test_exp_run_quantize_int8_writes_gates_and_registers_the_int8_model": 5,
}


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its file, or the test itself (SPLIT_FILES, SEPARATE_TESTS)."""
    file, _, name = nodeid.partition("::")
    alone = f"{Path(file).name}::{name.split('[', 1)[0]}" in SEPARATE_TESTS
    return nodeid if alone or Path(file).name in SPLIT_FILES else file


def unit_minutes(unit: str) -> float:
    """A work unit's rank: its own minutes, else its file's (a split file's, for each test)."""
    file, _, name = unit.partition("::")
    key = f"{Path(file).name}::{name.split('[', 1)[0]}"
    return SEPARATE_TESTS.get(key, FILE_MINUTES.get(Path(file).name, 0.0))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadfile, longest work first (xdist's own order is by number of tests, which
    leaves the few long pipeline and server tests for last), in units of ``unit_of``."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if not self.ordered:  # the first call: the queue is complete, nothing sent yet
                units = sorted(self.workqueue.items(), key=lambda u: -unit_minutes(u[0]))
                self.workqueue = OrderedDict(units)
                self.ordered = True
            super()._assign_work_unit(node)

    return LongestFirst(config, log)
