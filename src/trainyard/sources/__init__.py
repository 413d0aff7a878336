"""Data sources: one module per kind of input, each producing the prepared format + card.

- ``fashion_mnist`` (+ ``fashion_fetch``): the embedded default, four IDX files;
- ``folder``: any class-per-subfolder tree of images.

Adding a source touches nothing downstream: train, export, evaluate and the service read
only the prepared arrays and the dataset card (``trainyard.card``).
"""
