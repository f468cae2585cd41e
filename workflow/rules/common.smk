from snakemake.utils import validate


validate(config, "../schemas/config.schema.yaml")
