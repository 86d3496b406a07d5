"""Regenerate assistant turns through an OpenAI-compatible server (vLLM, SGLang, llama.cpp).

    dflash-train regenerate --server http://127.0.0.1:8000 --model Qwen/Qwen3-8B --concurrency 64 \\
        --data sharegpt --limit 20000 --max-new-tokens 512 --out regen.jsonl \\
        --chat-template-kwargs '{"enable_thinking": false}' --target Qwen/Qwen3-8B

Same contract as the in-process path (data/regenerate.py), same file (data/regen_common.py):
system and user turns kept, each assistant turn rewritten given the history *as regenerated so
far*, one fsync'ed JSONL line per finished conversation, resumable by id, `--samples N` as records
`ID#0..`. A file written with other settings is refused; the server URL and the model count among
them (`server`, `regenerated_by` in every line).

Concurrency: `concurrency` workers each carry one conversation through its turns, so at most that
many requests are in flight. A conversation is written (and fsync'ed) as soon as its last turn is
back: lines are in completion order, and a killed run loses only the conversations in flight.

Failures: before any work, one GET /v1/models: a malformed or wrong URL, a refused connection, a
refused key or a model the server does not serve is a one-line usage error (exit 2), nothing
written. During the run, timeouts, dropped connections, 429 and 5xx are retried with exponential
backoff (`retries` times); a request that still fails, or gets another 4xx, fails its
conversation: not written (a rerun retries it), counted. `max_failures` failures in a row stop
the run with one line (ServerUnavailable, exit 1); every conversation finished before is on disk.
A run whose every conversation failed (fewer than `max_failures`) ends the same way (NothingWritten,
exit 1), naming the count and the first error.

Secrets: the API key and a URL's user:password are never printed or written. The URL in records and
messages is stripped of its credentials (sent as basic auth instead), and every message, a server's
error body included (some echo the request's headers), has the key and the password redacted.

Sampling: temperature as given, with top_p 1, top_k and min_p off: the target's own tempered
distribution, as in-process (llama.cpp's defaults, top_k 40, top_p 0.95, min_p 0.05, would cut
its tail). At T > 0 each request carries a seed derived from --seed, the record id and the turn.

Tokens: every reply's `completion_tokens` (the server's count) and finish reason go in the record
(`replies`, one entry per assistant turn). Token ids: the server's own where it returns them
(vLLM's `return_token_ids`; `token_ids_from: "server"`), else the reply re-tokenised with the
target's tokenizer when --target is given (`token_ids_from: "tokenizer:<target>"`), else none.

Reasoning (`--reasoning`): a server with a reasoning parser returns the thinking apart
(`reasoning_content`, or `reasoning` in newer vLLM); without one it is inline in <think>...</think>.
`keep` writes it inline either way (`<think>\\n...\\n</think>\\n\\n` + answer), so the record does not
depend on the server's parser; `drop` writes the answer alone.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import random
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

try:
    import httpx2 as httpx  # the maintained httpx line (same API); huggingface_hub depends on it too
except ImportError:  # older huggingface_hub stacks ship httpx; train imports this module's config either way
    try:
        import httpx
    except ImportError:
        httpx = None  # only --server needs it (checked when the client starts)
from tqdm import tqdm

from dflash_train.data.regen_common import (
    Message,
    RegenConfig,
    RegenReport,
    append,
    pending,
    reply_segments,
    resume,
    with_samples,
    without_credentials,
)
from dflash_train.data.sources import Conversation
from dflash_train.data.tokenize import template_ids
from dflash_train.errors import UsageError

REASONING = ("keep", "drop")
MAX_BACKOFF_S = 30.0
PREFLIGHT_TIMEOUT_S = 30.0


class ServerUnavailable(UsageError):
    """The server stopped answering mid-run. One line like a usage error, but exit code 1: the
    command was right, and rerunning it once the server is back continues where it stopped."""

    exit_code = 1


class NothingWritten(ServerUnavailable):
    """Every conversation the run tried failed (fewer than the breaker's count): exit 1, not a
    success that wrote nothing."""


def _setting(name: str):
    """The default of [regeneration]'s `name` (regen_common.RegenConfig holds each server setting's one default)."""
    return next(f.default for f in fields(RegenConfig) if f.name == name)


@dataclass(kw_only=True, slots=True)
class ServerConfig:
    """The client's settings, checked: [regeneration]'s server fields (server_config builds it from them)."""

    url: str
    """Base URL of an OpenAI-compatible server, with or without the trailing /v1 (--server)."""
    model: str | None = None
    """The model as the server lists it in /v1/models; None = the only one it serves (--model)."""
    concurrency: int = _setting("concurrency")
    api_key_env: str | None = None
    """Environment variable holding the API key, sent as a bearer token (--api-key-env)."""
    chat_template_kwargs: dict | None = None
    """Passed through to the server's chat template, e.g. {"enable_thinking": false} (--chat-template-kwargs)."""
    reasoning: str = _setting("reasoning")
    request_timeout: float = _setting("request_timeout")
    retries: int = _setting("retries")
    max_failures: int = _setting("max_failures")
    backoff: float = 0.5
    """Seconds before the first retry; doubled at each, jittered, at most 30 s."""
    credentials: tuple[str, str] | None = field(default=None, init=False, repr=False)
    """user and password of a URL http://user:password@host, sent as basic auth; `url` is kept without them."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"--server must be an http:// or https:// URL such as http://127.0.0.1:8000, "
                             f"got {without_credentials(self.url)!r}")
        if "@" in parts.netloc:
            self.credentials = (unquote(parts.username or ""), unquote(parts.password or ""))
        self.url = without_credentials(self.url).rstrip("/").removesuffix("/v1").rstrip("/")
        if self.concurrency < 1:
            raise UsageError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.reasoning not in REASONING:
            raise UsageError(f"--reasoning must be keep or drop, got {self.reasoning!r}")
        if not self.request_timeout > 0:
            raise UsageError(f"--request-timeout must be > 0, got {self.request_timeout}")
        if self.retries < 0:
            raise UsageError(f"--retries must be >= 0, got {self.retries}")
        if self.max_failures < 1:
            raise UsageError(f"--max-failures must be >= 1, got {self.max_failures}")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise UsageError(f"--chat-template-kwargs must be a JSON object, got {self.chat_template_kwargs!r}")

    def api_key(self) -> str | None:
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise UsageError(f"--api-key-env {self.api_key_env}: the environment variable is not set")
        return key

    def redact(self, text: str) -> str:
        """`text` with the key and the URL's password replaced: a server may echo a request's headers
        in its error body, and what we print ends up in logs."""
        for secret in sorted(self._secrets(), key=len, reverse=True):
            text = text.replace(secret, "<redacted>")
        return text

    def _secrets(self) -> list[str]:
        found = [os.environ.get(self.api_key_env) or ""] if self.api_key_env else []
        if self.credentials is not None:
            user, password = self.credentials
            token = base64.b64encode(f"{user}:{password}".encode()).decode()  # the Authorization: Basic header
            found += [password, quote(password, safe=""), token]
        return [s for s in found if s]


def server_config(cfg: RegenConfig) -> ServerConfig:
    """The client's settings from [regeneration] (cfg.server must be set)."""
    return ServerConfig(url=cfg.server, model=cfg.model, concurrency=cfg.concurrency, api_key_env=cfg.api_key_env,
                        chat_template_kwargs=parse_template_kwargs(cfg.chat_template_kwargs),
                        reasoning=cfg.reasoning, request_timeout=cfg.request_timeout, retries=cfg.retries,
                        max_failures=cfg.max_failures)


def parse_template_kwargs(text: str | None) -> dict | None:
    """--chat-template-kwargs '{"enable_thinking": false}' -> a dict."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--chat-template-kwargs: not JSON ({e.msg} at character {e.pos}): {text!r}") from None
    if not isinstance(value, dict):
        raise UsageError(f"--chat-template-kwargs must be a JSON object such as '{{\"enable_thinking\": false}}', "
                         f"got {text!r}")
    return value


def regenerate_via_server(conversations: Iterable[Conversation], out_path: Path, cfg: RegenConfig,
                          server: ServerConfig, tokenizer=None, tokenizer_name: str | None = None,
                          progress: bool = True) -> RegenReport:
    """Append every conversation not yet in `out_path`, its assistant turns written by the server.

    `tokenizer` (the target's, optional) re-tokenises replies the server returns no token ids for,
    and counts each later turn's prompt against cfg.max_context (which needs it).
    """
    if cfg.max_context is not None and tokenizer is None:
        raise UsageError("--max-context with --server needs --target: its tokenizer counts each prompt's tokens")
    try:
        return asyncio.run(_Run(conversations, Path(out_path), cfg, server, tokenizer, tokenizer_name, progress).main())
    except UsageError as e:  # every message we print, whichever part of the run wrote it
        raise type(e)(server.redact(str(e))) from None


@dataclass
class _Reply:
    text: str
    meta: dict  # what the record keeps of the reply: finish reason, token count, token ids


class _Run:
    """One regeneration run: the HTTP client, the output file, the counters and the breaker."""

    def __init__(self, conversations, out_path: Path, cfg: RegenConfig, server: ServerConfig, tokenizer,
                 tokenizer_name: str | None, progress: bool):
        self.conversations, self.out_path, self.cfg, self.server = conversations, out_path, cfg, server
        self.tokenizer, self.tokenizer_name, self.progress = tokenizer, tokenizer_name, progress
        self.report = RegenReport(written=0, already_done=0, generated_tokens=0, seconds=0.0, hit_length_limit=0)
        self.failures_in_row = 0
        self.first_error: str | None = None  # of a conversation that failed for good
        self.model = server.model or ""  # then the name /v1/models confirms
        self.header: dict = {}
        self.client: httpx.AsyncClient | None = None  # set while main() runs, with the file and the bar
        self.out = self.bar = None
        self.t0 = time.perf_counter()

    async def main(self) -> RegenReport:
        t0 = self.t0 = time.perf_counter()
        key = self.server.api_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if httpx is None:
            raise UsageError("--server needs PyPI httpx2 (or httpx): pip install httpx2")
        timeout = httpx.Timeout(self.server.request_timeout, connect=min(10.0, self.server.request_timeout))
        limits = httpx.Limits(max_connections=self.server.concurrency,
                              max_keepalive_connections=self.server.concurrency)
        auth = httpx.BasicAuth(*self.server.credentials) if self.server.credentials else None
        async with httpx.AsyncClient(base_url=self.server.url, headers=headers, auth=auth, timeout=timeout,
                                     limits=limits) as client:
            self.client = client
            self.model = await self._preflight()
            self.header = {"regenerated_by": self.model, "server": self.server.url, **self.cfg.settings(),
                           "chat_template_kwargs": self.server.chat_template_kwargs, "reasoning": self.server.reasoning}
            done = resume(self.out_path, self.header)
            convs = self.conversations
            total = len(convs) * self.cfg.samples if hasattr(convs, "__len__") else None
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.out_path, "ab") as self.out, \
                    tqdm(total=total, desc="regenerate", unit="conv", disable=not self.progress) as self.bar:
                todo = pending(with_samples(convs, self.cfg.samples), done, self.report, self.bar)
                try:
                    await self._run_all(todo)
                finally:
                    self.report.seconds = time.perf_counter() - t0
        self._check_any_written()
        return self.report

    def _check_any_written(self) -> None:
        rep = self.report
        if rep.failed and not rep.written:
            raise NothingWritten(f"--server {self.server.url}: all {rep.failed} conversations this run tried failed "
                                 f"(none written), the first with: {self.first_error}")

    # --- before any work: is this the server and the model we think? ---------------------------

    async def _preflight(self) -> str:
        url = self.server.url
        try:
            resp = await self.client.get("/v1/models", timeout=PREFLIGHT_TIMEOUT_S)
        except httpx.ConnectError as e:
            raise UsageError(f"--server {url}: cannot connect ({_reason(e)}); is the server running there?") from None
        except httpx.TimeoutException:
            raise UsageError(f"--server {url}: no answer to GET /v1/models within "
                             f"{PREFLIGHT_TIMEOUT_S:.0f} s") from None
        except httpx.HTTPError as e:
            raise UsageError(f"--server {url}: GET /v1/models failed ({_reason(e)})") from None
        if resp.status_code in (401, 403):
            raise UsageError(self._auth_error(resp))
        if resp.status_code != 200:
            raise UsageError(f"--server {url}: GET /v1/models answered HTTP {resp.status_code}; give the base URL of "
                             "an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
        try:
            models = resp.json()["data"]
            names = [m["id"] for m in models]
            aliases = [a for m in models for a in m.get("aliases") or []]  # llama.cpp lists --alias names here
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"--server {url}: GET /v1/models did not answer an OpenAI model list; "
                             "is this an OpenAI-compatible server?") from None
        if self.server.model is None:
            if len(names) != 1:
                raise UsageError(f"--model: {url} serves {len(names)} models ({', '.join(names) or 'none'}); "
                                 "name one")
            return names[0]
        if self.server.model not in names and self.server.model not in aliases:
            raise UsageError(f"--model {self.server.model}: not served by {url} (it serves: {', '.join(names)})")
        return self.server.model

    def _auth_error(self, resp) -> str:
        code = resp.status_code
        if self.server.api_key_env is None:
            return (f"--server {self.server.url}: HTTP {code}: the server wants an API key; "
                    "give it with --api-key-env VAR")
        return f"--api-key-env {self.server.api_key_env}: the server refused that key (HTTP {code})"

    # --- the run ---------------------------------------------------------------------------------

    async def _run_all(self, todo) -> None:
        jobs: asyncio.Queue = asyncio.Queue(maxsize=self.server.concurrency)  # bounded: input read as needed

        async def produce():
            for conv in todo:
                await jobs.put(conv)
            for _ in range(self.server.concurrency):
                await jobs.put(None)  # one stop signal per worker

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(produce())
                for _ in range(self.server.concurrency):
                    tg.create_task(self._worker(jobs))
        except BaseExceptionGroup as group:
            # One task failed (the breaker, a refused key); the group cancelled the others, whose
            # conversations in flight are simply not written. Report the cause, not the group.
            raise group.exceptions[0] from None

    async def _worker(self, jobs: asyncio.Queue) -> None:
        while (conv := await jobs.get()) is not None:
            record = await self._conversation(conv)
            if record is not None:
                # Synchronous write + fsync on the event loop: a line is never half-written by a
                # cancelled task, and at ~1 ms per fsync it caps the rate near 1,000 conversations/s.
                append(self.out, [record])
                self.report.written += 1
            self.bar.update(1)

    async def _conversation(self, conv: Conversation) -> dict | None:
        history: list[Message] = []
        replies = []
        for turn, segment in enumerate(reply_segments(conv, self.cfg.turns)):
            if turn and self._reaches_context(history + segment):
                self.report.context_cut += 1  # the conversation ends at its last reply, as in-process
                break
            history.extend(segment)
            reply = await self._complete(history, _request_seed(self.cfg.seed, conv.id, turn))
            if reply is None:
                return None  # failed for good: the whole conversation is redone by a rerun
            history.append({"role": "assistant", "content": reply.text})
            replies.append(reply.meta)
        return {"id": conv.id, "messages": history, **self.header, "replies": replies}

    def _reaches_context(self, messages: list[Message]) -> bool:
        """Whether this prompt has cfg.max_context tokens or more, through the target's tokenizer and chat
        template. The server may render a few tokens differently: a guard against regenerating
        histories that would not be trained on, not an exact limit."""
        if self.cfg.max_context is None:
            return False
        kwargs = self.server.chat_template_kwargs or {}
        ids = template_ids(self.tokenizer, messages, add_generation_prompt=True, **kwargs)
        return len(ids) >= self.cfg.max_context

    def _body(self, messages: list[Message], seed: int) -> dict:
        body = {"model": self.model, "messages": messages, "max_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                "return_token_ids": True}  # vLLM: the generated ids; other servers ignore the field
        if self.cfg.temperature > 0:
            body["seed"] = seed
        if self.server.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = self.server.chat_template_kwargs
        return body

    async def _complete(self, messages: list[Message], seed: int) -> _Reply | None:
        """One reply, retried on timeouts, dropped connections, 429 and 5xx; None when it failed for good."""
        body = self._body(messages, seed)
        error = ""
        for attempt in range(self.server.retries + 1):
            if attempt:
                self.report.retries += 1
                delay = min(MAX_BACKOFF_S, self.server.backoff * 2 ** (attempt - 1))
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # jitter: workers do not retry in lockstep
            try:
                resp = await self.client.post("/v1/chat/completions", json=body)
            except httpx.TimeoutException:
                error = f"no answer within {self.server.request_timeout:g} s"
                continue
            except httpx.TransportError as e:  # refused, reset, closed mid-response
                error = _reason(e)
                continue
            if resp.status_code == 200:
                try:
                    reply = self._reply(resp.json())
                except (ValueError, KeyError, TypeError, IndexError):
                    error = f"an answer that is not a chat completion: {resp.text[:200]!r}"
                    break
                self.failures_in_row = 0
                return reply
            if resp.status_code in (401, 403):
                raise UsageError(self._auth_error(resp))  # no point in going on: every request would fail
            error = f"HTTP {resp.status_code}: {_server_message(resp)}"
            if not (resp.status_code == 429 or resp.status_code >= 500):
                break  # the request itself is wrong (e.g. too long for the context): retrying repeats it
        self._failed(error)
        return None

    def _failed(self, error: str) -> None:
        error = self.server.redact(error)
        self.first_error = self.first_error or error
        self.report.failed += 1
        self.failures_in_row += 1
        if self.failures_in_row >= self.server.max_failures:
            raise ServerUnavailable(
                f"--server {self.server.url}: {self.failures_in_row} requests in a row failed "
                f"(each tried {self.server.retries + 1} times), the last with: {error}; stopped. "
                f"{self.report.written} conversations written by this run are in {self.out_path}; "
                "rerun the same command to continue")

    def _reply(self, data: dict) -> _Reply:
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        text, had_reasoning = _with_reasoning(content, reasoning, self.server.reasoning)
        usage = data.get("usage") or {}
        server_ids = choice.get("token_ids")
        meta: dict = {"finish_reason": choice.get("finish_reason")}
        if _is_ids(server_ids) and not (had_reasoning and self.server.reasoning == "drop"):
            ids, source = server_ids, "server"  # the tokens the target generated, exactly
        elif self.tokenizer is not None:
            ids, source = self.tokenizer.encode(text, add_special_tokens=False), f"tokenizer:{self.tokenizer_name}"
        else:
            ids, source = None, None
        n_tokens = usage.get("completion_tokens")
        if not isinstance(n_tokens, int):
            n_tokens = len(server_ids) if _is_ids(server_ids) else len(ids or [])
        meta["completion_tokens"] = n_tokens
        if ids is not None:
            meta["token_ids"], meta["token_ids_from"] = ids, source
        self._count(text, n_tokens, meta["finish_reason"] == "length")
        return _Reply(text, meta)

    def _count(self, text: str, n_tokens: int, hit_limit: bool) -> None:
        rep = self.report
        rep.requests += 1
        rep.turns += 1
        rep.generated_tokens += n_tokens
        rep.hit_length_limit += hit_limit
        rep.empty_replies += not text.strip()
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix(req_s=f"{rep.requests / elapsed:.1f}", tok_s=f"{rep.generated_tokens / elapsed:.0f}",
                             refresh=False)


# --- helpers -----------------------------------------------------------------------------------

_THINK = re.compile(r"^\s*<think>(.*?)(?:</think>\s*|$)", re.DOTALL)


def _with_reasoning(content: str, reasoning: str | None, mode: str) -> tuple[str, bool]:
    """The reply text as written to the record, and whether the reply had any reasoning."""
    if reasoning:
        if mode == "drop":
            return content.lstrip(), True
        return f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}", True
    m = _THINK.match(content)
    if m is None:
        return content, False
    # Inline (no reasoning parser on the server). Unclosed: the reply hit the limit while thinking.
    return (content if mode == "keep" else content[m.end():]), True


def _request_seed(seed: int, record_id: str, turn: int) -> int:
    """A seed per (run seed, record, turn): a resumed run asks for the same draws it would have."""
    digest = hashlib.sha256(f"{seed}:{record_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) for t in value)


def _reason(e: BaseException) -> str:
    """The OS's word for a network error where there is one ("Connection refused"), else the error's."""
    seen, cause = set(), e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        for err in (cause, *getattr(cause, "exceptions", ())):  # anyio groups one attempt per address
            if isinstance(err, OSError) and err.errno and err.errno > 0:
                return os.strerror(err.errno)  # "Connection refused", whatever the wrapper's text
            if isinstance(err, OSError) and err.strerror:
                return err.strerror  # e.g. a DNS failure: "Name or service not known"
        cause = cause.__cause__ or cause.__context__
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:200]


def _server_message(resp) -> str:
    """The error message of an OpenAI-style error body, else the start of the body."""
    try:
        err = resp.json().get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            return str(msg).splitlines()[0][:300]
    except (ValueError, AttributeError):
        pass
    return resp.text.strip().splitlines()[0][:300] if resp.text.strip() else "(empty body)"
