"""An OpenAI-compatible HTTP server for an engine model: mlx-lm's own server (`mlx_lm.server`:
`/v1/chat/completions`, `/v1/completions`, streamed and not, its samplers and options), whose
model provider loads the model through the engine instead of keeping every expert in memory.

    python -m engine serve --model olmoe-tiny --memory 64MB --port 8080

The engine keeps per-step state (the expert cache's counters, the prefetcher's reads in flight),
so requests are served one after the other (the provider says the model is not batchable), each
in mlx-lm's generation thread, where the engine is also loaded.
"""

import json
import sys

import mlx_lm.server as mlx_server
from mlx_lm.processors import load_processor

from .api import load
from .config import EngineConfig
from .models import registry


class EngineModelProvider(mlx_server.ModelProvider):
    """mlx-lm's ModelProvider, loading `--model` (a Titan model id) as an engine."""

    def __init__(self, cli_args, engine_config: EngineConfig):
        super().__init__(cli_args)
        self.engine_config = engine_config
        self.engine = None

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if adapter_path is not None or draft_model_path is not None:
            raise ValueError("the engine serves its model as it is: no adapters, no draft model")
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.reset()
        eng = load(model_path, self.engine_config)
        config = json.loads((registry.model_dir(model_path) / "config.json").read_text())
        self.engine = eng
        self.model_key = (model_path, None, None)
        self.model = eng.model
        self.tokenizer = eng.tokenizer
        self.processor = load_processor(eng.model, config)
        self.draft_model = None
        self.is_batchable = False  # one request at a time: the expert cache is one per engine


def main(model_id: str, engine_config: EngineConfig, server_args: list):
    """Run mlx-lm's server (its own command line: `server_args`) over an engine of `model_id`."""
    registry.get_spec(model_id)  # an unknown model is refused before the server starts
    argv = sys.argv
    sys.argv = ["mlx_lm.server", "--model", model_id, *server_args]
    real = mlx_server.ModelProvider
    mlx_server.ModelProvider = lambda cli_args: EngineModelProvider(cli_args, engine_config)
    try:
        mlx_server.main()
    finally:
        mlx_server.ModelProvider = real
        sys.argv = argv
