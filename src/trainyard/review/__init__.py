"""review: the labelling loop with a person (``trainyard label push|pull``, docs/label.md):
which images to send, and the reviewed answers back into the folder with nothing lost."""
