"""The ZeRO package's former name. It is :mod:`infinity.sharding` now; importing this module
raises an error that says so."""

raise ImportError(
    "infinity.dist was renamed infinity.sharding: import infinity.sharding instead "
    "(the same names: save_sharded, load_sharded, full_state_dict, Partitioner, ...)"
)
