"""The bottom floor: helpers every other floor may use and that import nothing of kvlab (I/O and logging, the
device and dtype, the typed columns of tables a run may leave empty, the public-domain prose, the parameters that
method and task kinds declare)."""
