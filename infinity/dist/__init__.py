"""Deprecated alias of :mod:`infinity.sharding` (the ZeRO sharding package was named ``dist``,
which tools and people read as build output). ``infinity.dist.save_sharded``,
``full_state_dict`` and the rest, and the submodules (``infinity.dist.checkpoint`` ...), keep
working: they are the very objects of :mod:`infinity.sharding`. Import ``infinity.sharding``."""
import importlib
import sys
import warnings

from infinity.sharding import *  # noqa: F401,F403
from infinity.sharding import __all__  # noqa: F401

warnings.warn("infinity.dist is renamed infinity.sharding; import infinity.sharding (the old "
              "name keeps working for now)", DeprecationWarning, stacklevel=2)

for _name in ("checkpoint", "collectives", "group", "partitioner", "shard_flat", "sharded_home",
              "state"):
    sys.modules[f"{__name__}.{_name}"] = importlib.import_module(f"infinity.sharding.{_name}")
    setattr(sys.modules[__name__], _name, sys.modules[f"{__name__}.{_name}"])
