"""Experiments at scale, above the stages: what ``trainyard tune`` runs (Optuna trials of
the train stage's fit) and ``trainyard report``'s report (a change against a baseline
revision). Their command lines are trainyard.commands.tune and .pr_report."""
