"""Experiments at scale, above the stages: what ``trainyard tune`` runs (Optuna trials of
the train stage's fit) and ``trainyard report``'s report (a change against a baseline
revision). Their command lines are trainyard.commands.tune and .pr_report."""

from pathlib import Path

# ``trainyard report``'s defaults, here so that the command's --help says them without
# importing the report's module (and DVC with it).
DEFAULT_OUT = Path("reports/report.md")
DEFAULT_BASELINE = "main"
