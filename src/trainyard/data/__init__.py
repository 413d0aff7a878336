"""data: the sources (Fashion-MNIST, your own folder), the prepared format, the datamodule and
the hardware decisions about where the splits live. Imports core only (and torch).
"""
