"""An OpenAI-compatible HTTP server for an engine model: mlx-lm's own server (`mlx_lm.server`:
`/v1/chat/completions`, `/v1/completions`, streamed and not, its samplers and options), whose
model provider loads the model through the engine instead of keeping every expert in memory.

    python -m engine serve --model olmoe-tiny --memory 64MB --port 8080

What it adds to mlx-lm's server, so that no client can stick it or make it build anything:
- the engine is loaded (and every option checked) before the port opens: a bad option or a
  model that cannot load is an error at start, not a dead generation thread later;
- a request names the served model or none (`"model"`: its id or `default_model`); any other is
  404, and nothing is loaded or built on demand; `GET /v1/models` lists the served model;
- `max_tokens` above the model's context is 400, and generation stops at the context;
- a request stops generating when its client goes away (streamed or not) or after
  `--request-timeout` seconds (its answer then ends with `finish_reason: "length"`);
- at most `--queue` requests are admitted at once (one generating, the others waiting their
  turn); past that a request gets 503 with `Retry-After`;
- a chat needs a non-empty list of messages whose contents are text: anything else is 400.

The engine keeps per-step state (the expert cache's counters, the prefetcher's reads in flight),
so requests are served one after the other (the provider says the model is not batchable: mlx-lm's
batched decode would route a batch's rows through one slot table at once), each in mlx-lm's
generation thread, where the engine is also loaded.
"""

import json
import logging
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from http.server import ThreadingHTTPServer

import mlx_lm.server as mlx_server
from mlx_lm.processors import load_processor

from .api import load
from .config import EngineConfig
from .models import registry


@dataclass
class ServeLimits:
    context: int  # the model's context: max_tokens above it is refused, generation stops at it
    queue: int = 8  # requests admitted at once (one generating, the rest waiting)
    request_timeout: float = 300.0  # seconds a request may generate
    retry_after: int = 5  # seconds a 503 asks the client to wait


class EngineModelProvider(mlx_server.ModelProvider):
    """mlx-lm's ModelProvider, loading `--model` (a Titan model id) as an engine, once: a load
    failure is kept for the caller (the server does not open its port) instead of killing the
    generation thread."""

    def __init__(self, cli_args, engine_config: EngineConfig):
        super().__init__(cli_args)
        self.engine_config = engine_config
        self.engine = None
        self.load_error = None
        self.loaded = threading.Event()

    def load_default(self):
        try:
            super().load_default()
        except Exception as e:  # noqa: BLE001 - handed to the main thread, which names it and exits
            self.load_error = e
        finally:
            self.loaded.set()

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        if adapter_path is not None or draft_model_path is not None:
            raise ValueError("the engine serves its model as it is: no adapters, no draft model")
        if model_path != self.cli_args.model:  # the handler refuses other models; never build one here
            raise ValueError(f"this server serves '{self.cli_args.model}' only, not '{model_path}'")
        if self.engine is not None:
            return
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


class ClientGone(Exception):
    """The client closed its connection while its answer was being generated."""


def client_gone(conn: socket.socket) -> bool:
    """Whether the peer has closed `conn` (readable with nothing to read), without blocking."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class _Guarded:
    """The response generator as one request's handler sees it: its tokens stop when the client
    goes away (ClientGone), at the deadline or at the model's context (the last token then says
    `length`)."""

    def __init__(self, real, conn, limits: ServeLimits, max_tokens: int):
        self._real, self._conn, self._limits, self._max_tokens = real, conn, limits, max_tokens

    def __getattr__(self, name):
        return getattr(self._real, name)

    def generate(self, request, args, progress_callback=None):
        ctx, tokens = self._real.generate(request, args, progress_callback=progress_callback)
        deadline = time.monotonic() + self._limits.request_timeout
        room = max(1, self._limits.context - len(ctx.prompt))

        def guarded():
            n = 0
            for r in tokens:
                n += 1
                if client_gone(self._conn):
                    ctx.stop()
                    raise ClientGone(f"client went away after {n} tokens")
                if r.finish_reason is None and (n >= room or time.monotonic() > deadline):
                    ctx.stop()  # the generation thread stops after at most one more token
                    yield replace(r, finish_reason="length")
                    return
                yield r

        return ctx, guarded()


def _message_error(messages) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {role, content} objects"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return f"messages[{i}] must be an object with a string role"
        content = m.get("content")
        if content is None and m.get("tool_calls"):
            continue
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    return f"messages[{i}].content[{j}] must be a text part ({{type: text, text: string}})"
        elif not isinstance(content, str):
            return f"messages[{i}].content must be a string or a list of text parts"
    return None


class EngineAPIHandler(mlx_server.APIHandler):
    """mlx-lm's request handler with the checks and limits of the module docstring."""

    def __init__(self, response_generator, model_id: str, limits: ServeLimits, admission, *args, **kw):
        self.model_id, self.limits, self.admission = model_id, limits, admission
        super().__init__(response_generator, *args, **kw)

    def _error(self, code: int, message: str, headers=()):
        body = json.dumps({"error": message}).encode()
        self._set_completion_headers(code)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def handle_chat_completions(self):
        why = _message_error(self.body.get("messages"))
        if why:
            raise ValueError(why)  # do_POST answers 400 with it
        return super().handle_chat_completions()

    def handle_text_completions(self):
        prompt = self.body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("prompt must be a non-empty string")
        return super().handle_text_completions()

    def handle_completion(self, request, stop_words):
        if self.requested_model not in ("default_model", self.model_id):
            return self._error(404, f"model '{self.requested_model}' is not served here; this server serves "
                                    f"'{self.model_id}' (GET /v1/models)")  # fmt: skip
        if self.requested_draft_model != "default_model" or self.adapter is not None:
            return self._error(400, "this server takes no draft model and no adapters")
        if self.max_tokens > self.limits.context:
            return self._error(400, f"max_tokens {self.max_tokens} exceeds the model's context of "
                                    f"{self.limits.context} tokens")  # fmt: skip
        if not self.admission.acquire(blocking=False):  # at most --queue requests inside; never wait here
            return self._error(
                503,
                f"{self.limits.queue} requests are already in the server (--queue); retry later",
                [("Retry-After", str(self.limits.retry_after))],
            )
        real = self.response_generator
        self.response_generator = _Guarded(real, self.connection, self.limits, self.max_tokens)
        try:
            super().handle_completion(request, stop_words)
        except (ClientGone, BrokenPipeError, ConnectionResetError) as e:
            logging.info(f"request stopped: {e}")
            self.close_connection = True
        finally:
            self.response_generator = real
            self.admission.release()

    def handle_models_request(self):
        entry = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "titan"}
        wanted = self.path[len("/v1/models") :].strip("/")
        if wanted and wanted != self.model_id:
            return self._error(404, f"model '{wanted}' is not served here; this server serves '{self.model_id}'")
        body = json.dumps(entry if wanted else {"object": "list", "data": [entry]}).encode()
        self._set_completion_headers(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def run(model_id: str, engine_config: EngineConfig, limits: ServeLimits, cli_args, ready=None):
    """Load the engine in mlx-lm's generation thread, then serve on cli_args' host and port until
    interrupted. `ready(address)` is called once the port is open."""
    provider = EngineModelProvider(cli_args, engine_config)
    generator = mlx_server.ResponseGenerator(provider, mlx_server.LRUPromptCache(cli_args.prompt_cache_size))
    provider.loaded.wait()
    if provider.load_error is not None:
        generator.stop_and_join()
        raise provider.load_error
    admission = threading.BoundedSemaphore(limits.queue)

    def handler(*args, **kw):
        return EngineAPIHandler(generator, model_id, limits, admission, *args,
                                system_fingerprint=mlx_server.get_system_fingerprint(), **kw)  # fmt: skip

    infos = socket.getaddrinfo(cli_args.host, cli_args.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    server_class = type("Server", (ThreadingHTTPServer,), {"address_family": family, "daemon_threads": True})
    try:
        httpd = server_class(address, handler)
    except OSError as e:
        generator.stop_and_join()
        raise ValueError(f"--host {cli_args.host} --port {cli_args.port}: {e.strerror}") from None
    logging.info(f"serving {model_id} at {cli_args.host} on port {httpd.server_address[1]}")
    if ready is not None:
        ready(httpd.server_address)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        generator.stop_and_join()


def main(model_id: str, engine_config: EngineConfig, limits: ServeLimits, server_args: list):
    """Run mlx-lm's server (its own command line: `server_args`) over an engine of `model_id`."""
    registry.get_spec(model_id)  # an unknown model is refused before the server starts
    taken = {"--model", "--adapter-path", "--draft-model"}
    for a in server_args:
        if a.split("=")[0] in taken:
            raise ValueError(f"{a.split('=')[0]}: the served model is the engine's --model; no adapters or draft")
    argv = sys.argv
    sys.argv = ["mlx_lm.server", "--model", model_id, *server_args]
    real = mlx_server.run

    def _run(host, port, provider):
        if not 1 <= provider.cli_args.max_tokens <= limits.context:
            raise ValueError(f"--max-tokens {provider.cli_args.max_tokens}: must lie within 1..{limits.context} "
                             "(the model's context)")  # fmt: skip
        if not 0 <= port <= 65535:
            raise ValueError(f"--port {port}: not a port (0 to 65535)")
        run(model_id, engine_config, limits, provider.cli_args)

    mlx_server.run = _run
    try:
        mlx_server.main()  # parses mlx-lm's own options (an error there names the option), then _run
    finally:
        mlx_server.run = real
        sys.argv = argv
