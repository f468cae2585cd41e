import sys

from snakemake.utils import validate


validate(config, "../schemas/config.schema.yaml")

# The interpreter running Snakemake runs the engine too (the project's virtual environment).
PYTHON = sys.executable
