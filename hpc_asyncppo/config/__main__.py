"""``python -m hpc_asyncppo.config``: every key with its default."""

from hpc_asyncppo.config import Config, to_yaml

print(to_yaml(Config()), end="")
