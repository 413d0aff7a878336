"""commands: one module per ``trainyard`` command (the list is trainyard.cli's COMMANDS).

Nothing is imported here, so one command module can be run alone (``python -m
trainyard.commands.doctor`` on a machine that has only torch) without the others' imports.
"""
