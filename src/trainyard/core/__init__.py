"""core: the params model, the dataset card, errors, atomic io + sha256, imaging (image -> pixels)
and its resize policies (resize_policy), the typed records stages hand each other (records).

The bottom layer: numpy, PIL and pydantic only, no torch, so the service can ship it.
"""
