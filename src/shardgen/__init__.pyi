# The package's public names and their types (shardgen/__init__.py imports the API when first used).
from shardgen.api import RunResult as RunResult
from shardgen.api import close as close
from shardgen.api import generate as generate
from shardgen.api import run as run
from shardgen.version import __version__ as __version__

__all__ = ["RunResult", "__version__", "close", "generate", "run"]
FEATURES: tuple[str, ...]
