"""An OpenAI-compatible HTTP server for an engine model: mlx-lm's own server (`mlx_lm.server`:
`/v1/chat/completions`, `/v1/completions`, streamed and not, its samplers and options), whose
model provider loads the model through the engine instead of keeping every expert in memory.

    python -m engine serve --model olmoe-tiny --memory 64MB --port 8080

What it adds to mlx-lm's server, so that no client can stick it or make it build anything:
- the engine is loaded (and every option checked) before the port opens: a bad option or a
  model that cannot load is an error at start, not a dead generation thread later;
- a request names the served model or none (`"model"`: its id or `default_model`); any other is
  404, and nothing is loaded or built on demand; `GET /v1/models` lists the served model;
- every field is checked before anything reaches MLX: the sampler's against their ranges
  (engine.sampling, the command line's too; `logit_bias` token ids within the vocabulary: one
  outside it double-frees in mlx-lm's sampler and ends the process), the others' types; a body
  that is not UTF-8, not JSON, nested past the parser or past MAX_BODY, or a bad
  `Content-Length`, is 400 (413); whatever a request raises is answered (500), never a closed
  socket;
- `max_tokens` above the model's context is 400, a prompt past it is 400, and generation stops at
  the context;
- a request's time limit (`--request-timeout` seconds) runs from when its generation starts and
  covers its prefill as well as its decode: the prefill is checked between its chunks
  (`--prefill-step-size` tokens), as is whether its client went away; a limit reached in the
  prefill is 503, in the decode the answer ends with `finish_reason: "length"`;
- at most `--queue` requests are admitted at once; past that a request gets 503 with `Retry-After`;
- Ctrl-C (or SIGTERM) ends every request in the server at its next prefill chunk (503) or token
  (`finish_reason: "length"`), then the server exits 0; `kill -USR1` writes every thread's stack;
- a chat needs a non-empty list of messages whose contents are text: anything else is 400.

Concurrent requests are decoded together, as mlx-lm's server does for a resident model (the
provider says the model is batchable: mlx-lm's BatchGenerator puts every request's next token
through a layer as one call, which the engine computes over its many-rows area, exactly mlx-lm's
rows; a prompt is prefilled chunk by chunk between the batch's decode steps). `--no-batch` serves
them one after the other through mlx-lm's single-sequence path, as does a request with a `seed`
(mlx-lm's rule). Everything runs in mlx-lm's generation thread, where the engine is also loaded.
"""

import faulthandler
import io
import json
import logging
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from http.server import ThreadingHTTPServer
from queue import Queue

import mlx.core as mx
import mlx_lm.server as mlx_server
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.processors import load_processor

from . import sampling
from .api import load
from .config import EngineConfig
from .models import registry

SHUTDOWN_LIMIT = 120  # seconds a stop may take (its requests end at their next chunk or token): then it is stuck
MAX_BODY = 16 << 20  # bytes a request's body may have: a chat of 16 MiB is far past any context here


@dataclass
class ServeLimits:
    context: int  # the model's context: max_tokens above it is refused, generation stops at it
    queue: int = 8  # requests admitted at once (generating in one batch, or waiting their turn)
    request_timeout: float = 300.0  # seconds a request may generate
    retry_after: int = 5  # seconds a 503 asks the client to wait
    vocab: int | None = None  # the model's vocabulary: a logit_bias token id must lie below it
    batch: bool = True  # concurrent requests decode as one batch (mlx-lm's BatchGenerator)

    def sampling(self) -> dict:
        """What engine.sampling checks a request's fields against."""
        return {"vocab": self.vocab, "context": self.context}


class EngineModelProvider(mlx_server.ModelProvider):
    """mlx-lm's ModelProvider, loading `--model` (a Titan model id) as an engine, once: a load
    failure is kept for the caller (the server does not open its port) instead of killing the
    generation thread."""

    def __init__(self, cli_args, engine_config: EngineConfig, batch: bool = True):
        super().__init__(cli_args)
        self.engine_config, self.batch = engine_config, batch
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
        # mlx-lm's own test (every layer's cache can merge into a batch's), unless --no-batch
        self.is_batchable = self.batch and all(hasattr(c, "merge") for c in make_prompt_cache(eng.model))


class ClientGone(Exception):
    """The client closed its connection while its answer was being generated."""


class Refused(BaseException):  # noqa: N818 - an answer, not an error of the server's
    """An HTTP answer for the client (`code`, `message`), raised through mlx-lm's handler, whose
    `except Exception` would answer 404 or close the socket: EngineAPIHandler.do_POST answers it."""

    def __init__(self, code: int, message: str, headers=()):
        super().__init__(message)
        self.code, self.message, self.headers = code, message, headers


class PromptTooLong(ValueError):
    """A prompt that leaves no room in the model's context for a token."""


class PrefillStopped(Exception):
    """Raised in the generation thread between two chunks of a prompt's prefill: its client went
    away or its time limit passed."""


STOPPING = "the server is stopping"


class Watch:
    """One request as the generation thread sees it between prefill chunks and tokens: its
    connection, its time limit (from when its generation starts), the server's stop (`stopping`,
    set by Ctrl-C or SIGTERM) and the prefill's progress."""

    def __init__(self, conn, timeout: float, stopping: threading.Event | None = None):
        self.conn, self.timeout, self.stopping = conn, timeout, stopping
        self.deadline, self.progress = None, (0, 0)

    def start(self):
        self.deadline = time.monotonic() + self.timeout

    def why_stop(self) -> str | None:
        if client_gone(self.conn):
            return "client went away"
        if self.stopping is not None and self.stopping.is_set():
            return STOPPING
        if self.deadline is not None and time.monotonic() > self.deadline:
            return "time limit"
        return None


class WatchedQueue(Queue):
    """A request's response queue (mlx-lm's generation thread puts its context, the prefill's
    progress at every chunk, then the tokens): putting the context starts the time limit, and
    putting progress stops the request's prefill where it is when it should stop. Served alone
    (`single`), PrefillStopped is raised out of mlx-lm's prefill, whose generation thread hands it
    back as the request's answer; in a batch, raising would end the batch's thread, so the request
    is stopped (mlx-lm removes it from the batch) and PrefillStopped is its answer."""

    def __init__(self, watch: Watch):
        super().__init__()
        self.watch, self.ctx, self.single, self.stopped = watch, None, False, False

    def put(self, item, block=True, timeout=None):
        if isinstance(item, mlx_server.GenerationContext):
            self.ctx = item
            self.watch.start()
        elif isinstance(item, tuple):
            self.watch.progress = item
            why = self.watch.why_stop()
            if why is not None:
                if self.single:
                    raise PrefillStopped(why)
                if self.stopped:  # the batch's steps until mlx-lm removes it: its answer is given
                    return
                self.stopped = True
                self.ctx.stop()
                item = PrefillStopped(why)
        super().put(item, block, timeout)


class EngineResponseGenerator(mlx_server.ResponseGenerator):
    """mlx-lm's response generator, with a prompt past the model's context refused when it is
    tokenized, and each request's queue watched (WatchedQueue)."""

    def __init__(self, provider, prompt_cache, context: int):
        self.context = context
        self.stopping = threading.Event()  # set at Ctrl-C: every request ends at its next chunk or token
        super().__init__(provider, prompt_cache)

    def _run_generate(self):
        try:
            super()._run_generate()
        finally:
            # MLX's streams end with the thread that made them, or the process aborts at exit
            # (`terminate called`, ml-explore/mlx#3126: MLX used in a thread)
            mx.clear_streams()

    def _serve_single(self, request, stream):
        rqueue = request[0]
        if isinstance(rqueue, WatchedQueue):
            rqueue.single = True
        super()._serve_single(request, stream)

    def _tokenize(self, tokenizer, request, args):
        out = super()._tokenize(tokenizer, request, args)
        n = len(out[0])
        if n + 1 > self.context:
            raise PromptTooLong(f"the prompt is {n} tokens, past the model's context of {self.context} tokens "
                                f"(a prompt may have at most {self.context - 1})")  # fmt: skip
        return out

    def generate(self, request, generation_args, progress_callback=None, watch: Watch | None = None):
        # mlx-lm's own generate (0.32.2), but for the queue: its Queue() is made inside it.
        response_queue = WatchedQueue(watch) if watch is not None else Queue()
        if not self.generation_available():
            raise RuntimeError("generation thread died")
        self.requests.put((response_queue, request, generation_args))

        def _inner():
            while True:
                response = self._await_response(response_queue)
                if response is None:
                    break
                if isinstance(response, Exception):
                    raise response
                if isinstance(response, tuple):
                    if progress_callback is not None:
                        progress_callback(*response)
                    continue
                yield response

        ctx = self._await_response(response_queue)
        if isinstance(ctx, Exception):
            raise ctx
        return ctx, _inner()


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
        watch = Watch(self._conn, self._limits.request_timeout, self._real.stopping)
        try:
            ctx, tokens = self._real.generate(request, args, progress_callback=progress_callback, watch=watch)
        except PromptTooLong as e:
            raise Refused(400, str(e)) from None
        room = max(1, self._limits.context - len(ctx.prompt))

        def stopped(e: PrefillStopped):
            done, total = watch.progress
            if str(e) == "client went away":
                return ClientGone(f"client went away after 0 tokens (in the prefill, {done} of {total} prompt tokens)")
            if str(e) == STOPPING:
                return Refused(503, f"{STOPPING} (in the prompt's prefill, {done} of {total} tokens)")
            return Refused(503, f"the request's time limit of {self._limits.request_timeout:g} s (--request-timeout) "
                                f"passed in its prompt's prefill ({done} of {total} tokens)")  # fmt: skip

        def guarded():
            n = 0
            it = iter(tokens)
            while True:
                try:
                    r = next(it)
                except StopIteration:
                    return
                except PrefillStopped as e:
                    raise stopped(e) from None
                n += 1
                why = watch.why_stop()  # the prefill's check, now between tokens
                if why == "client went away":
                    ctx.stop()
                    raise ClientGone(f"client went away after {n} tokens")
                if r.finish_reason is None and (n >= room or why in ("time limit", STOPPING)):
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


# request fields outside the sampler's that mlx-lm reads as these JSON types (None: may be absent)
FIELD_TYPES = {"stream_options": dict, "chat_template_kwargs": dict, "tools": list, "role_mapping": dict}
PATHS = ("/v1/completions", "/v1/chat/completions", "/chat/completions")


class EngineAPIHandler(mlx_server.APIHandler):
    """mlx-lm's request handler with the checks and limits of the module docstring."""

    # seconds a connection may leave the server waiting for its request or body (http.server sets
    # it on the socket): a client that sends less than its Content-Length holds a thread no longer
    timeout = 30

    def __init__(self, response_generator, model_id: str, limits: ServeLimits, admission, *args, **kw):
        self.model_id, self.limits, self.admission = model_id, limits, admission
        self.headers_sent = False
        super().__init__(response_generator, *args, **kw)

    def end_headers(self):
        self.headers_sent = True
        super().end_headers()

    def _body(self) -> bytes | None:
        """The request's body, read here so that what mlx-lm's do_POST would fail on (a negative or
        huge Content-Length, bytes that are not UTF-8, JSON nested past the parser) is refused by
        name; None where mlx-lm answers itself (an unknown path, no or a non-numeric length)."""
        if self.path not in PATHS:
            return None
        try:
            n = int(self.headers.get("Content-Length"))
        except (TypeError, ValueError):
            return None
        if n < 0:
            raise Refused(400, f"Content-Length {n}: must be 0 or more")
        if n > MAX_BODY:
            self.close_connection = True  # its body is left unread
            raise Refused(413, f"Content-Length {n}: a body may have at most {MAX_BODY} bytes")
        raw = self.rfile.read(n)
        if len(raw) < n:
            self.close_connection = True
            raise Refused(400, f"the body ended after {len(raw)} of its {n} bytes (Content-Length)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Refused(400, f"the body is not UTF-8 (byte {e.start})") from None
        try:
            json.loads(text)
        except RecursionError:
            raise Refused(400, "the body's JSON nests deeper than the parser allows") from None
        except ValueError:
            pass  # mlx-lm's do_POST answers it: 400 "Invalid JSON"
        return raw

    def do_POST(self):
        """mlx-lm's do_POST, with every request answered: a Refused as its code, anything else
        raised as a 500 (or, once a stream's headers are out, an error event that ends it)."""
        real = self.rfile
        try:
            raw = self._body()
            if raw is not None:
                self.rfile = io.BytesIO(raw)  # mlx-lm's do_POST reads the body again
            super().do_POST()
        except Refused as r:
            self._answer(r.code, r.message, r.headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - answered, and logged without a traceback
            logging.error(f"request failed: {type(e).__name__}: {e}")
            self._answer(500, f"the request failed: {type(e).__name__}: {e}")
        finally:
            self.rfile = real

    def _answer(self, code: int, message: str, headers=()):
        try:
            if self.headers_sent:  # a stream under way: its last event says what went wrong
                self.wfile.write(f"data: {json.dumps({'error': message})}\n\n".encode())
                self.wfile.flush()
                self.close_connection = True
            else:
                self._headers_buffer = []  # a 200 begun but not sent (http.server's buffer) is dropped
                self._error(code, message, headers)
        except OSError:
            self.close_connection = True

    def validate_model_parameters(self):
        # the sampler's fields first, by the name the request gave (mlx-lm's own check, next, would
        # name max_completion_tokens max_tokens); a ValueError is mlx-lm's 400
        sampling.check_request(self.body, self.limits.sampling())
        super().validate_model_parameters()
        for field, kind in FIELD_TYPES.items():
            if self.body.get(field) is not None and not isinstance(self.body[field], kind):
                raise ValueError(f"{field}: must be {'an object' if kind is dict else 'a list'}")
        usage = (self.body.get("stream_options") or {}).get("include_usage", False)
        if not isinstance(usage, bool):
            raise ValueError("stream_options.include_usage: must be true or false")
        if self.stream_options is not None:
            self.stream_options = {"include_usage": usage}  # mlx-lm reads the key as present

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
        if self.response_generator.stopping.is_set():  # a kept-alive connection's next request
            return self._error(503, STOPPING)
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
    provider = EngineModelProvider(cli_args, engine_config, limits.batch)
    generator = EngineResponseGenerator(provider, mlx_server.LRUPromptCache(cli_args.prompt_cache_size), limits.context)
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
    httpd = None
    try:
        try:
            httpd = server_class(address, handler)
        except OSError as e:
            raise ValueError(f"--host {cli_args.host} --port {cli_args.port}: {e.strerror}") from None
        if threading.current_thread() is threading.main_thread():  # a service manager's stop is Ctrl-C's
            # and Ctrl-C's own, even where the server was started with SIGINT ignored (a background
            # job of a script inherits that: a test suite run so sent SIGINT to a server that never
            # saw it, 2026-12-06)
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.default_int_handler)
            # `kill -USR1` writes every thread's stack to stderr: where a server that seems stuck is
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        logging.info(f"serving {model_id} at {cli_args.host} on port {httpd.server_address[1]}")
        if ready is not None:
            ready(httpd.server_address)
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):  # a second one would cut the shutdown short
                signal.signal(sig, signal.SIG_IGN)
        # Requests in the server end at their next prefill chunk (503) or token (`length`) rather
        # than run to their time limits one after another; a shutdown stuck past SHUTDOWN_LIMIT
        # writes every thread's stack to stderr and exits 1, so Ctrl-C always ends the server.
        generator.stopping.set()
        logging.info("stopping: requests in the server end at their next prefill chunk or token")
        faulthandler.dump_traceback_later(SHUTDOWN_LIMIT, exit=True)
        if httpd is not None:
            httpd.server_close()  # no new connection; the handlers' threads are daemons, never waited for
        for _ in range(limits.queue):  # so wait here until every request inside has been answered
            admission.acquire()
        generator.stop_and_join()
        # the engine's reader threads and streams end here, not in the interpreter's exit (where
        # MLX's threads, still running, ended the process with `terminate called` and exit 134)
        provider.engine.close()
        faulthandler.cancel_dump_traceback_later()


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
