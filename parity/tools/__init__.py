"""Tools: the `parity` command and the checkpoint inspector."""
