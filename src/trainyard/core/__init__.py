"""core: the params model, the dataset card, errors, atomic io + sha256, imaging (image -> pixels),
the typed records stages hand each other (records).

The bottom layer: numpy, PIL and pydantic only, no torch, so the service can ship it.
"""
