"""Regenerating through an OpenAI-compatible server: a real llama.cpp server (PyPI xllamacpp, the
C++ llama-server with continuous batching) on 127.0.0.1 serving the embedded SmolLM2 GGUF.

No mock server: every HTTP test talks to llama.cpp. Kept small (a handful of conversations, 8-24
tokens a turn): the module's wall time is ~15 s on 2 cores.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.data import regen_client as rc
from dflash_train.data.regen_common import RegenConfig, check_same_run
from dflash_train.data.sources import Conversation
from dflash_train.errors import UsageError
from dflash_train.models.loading import embedded_gguf_path, load_tokenizer

pytestmark = pytest.mark.slow  # starts a llama.cpp server process

ROOT = Path(__file__).resolve().parents[1]
KEY_ENV, KEY = "DFLASH_TEST_SERVER_KEY", "test-key-17"
ALIAS = "smollm2-135m"


class LlamaServer:
    """tests/llama_server.py in a subprocess: started on a free (or given) port, stopped by signal."""

    def __init__(self, port: int = 0, parallel: int = 4):
        cmd = [sys.executable, str(ROOT / "tests" / "llama_server.py"), str(embedded_gguf_path()), "--alias", ALIAS,
               "--api-key", KEY, "--parallel", str(parallel), "--port", str(port),
               # One thread: llama.cpp's threads spin at barriers, so with the CPU shared (pytest -n 2, the
               # client) two threads can run ~10x slower than one; the tests want robustness, not speed.
               "--threads", "1"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline()  # blocks until the model is loaded and the port listens
        if not line.startswith("listening "):
            self.proc.kill()
            raise RuntimeError(f"llama.cpp server did not start (is xllamacpp installed? bash scripts/install.sh "
                               f"test): {line!r}")
        self.url = line.split()[1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def server():
    srv = LlamaServer()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def user(text):
    return {"role": "user", "content": text}


def asst(text):
    return {"role": "assistant", "content": text}


def convs(n: int) -> list[Conversation]:
    return [Conversation(f"q{i}", [user(f"Name one fact about the number {i}."), asst("original")]) for i in range(n)]


def write_source(path: Path, conversations: list[Conversation]) -> Path:
    path.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in conversations))
    return path


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def server_cfg(url, **kw) -> rc.ServerConfig:
    return rc.ServerConfig(url=url, api_key_env=KEY_ENV, **kw)


def cli_args(url, source, out, *extra) -> list[str]:
    return ["regenerate", "--server", url, "--api-key-env", KEY_ENV, "--data", str(source), "--out", str(out),
            "--quiet", *extra]


def start_cli(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "dflash_train.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_bytes().count(b"\n") >= n:
            return
        assert proc.poll() is None, f"the run ended before writing {n} lines: {proc.communicate()}"
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} lines in {path} after {timeout} s")


# --- a real server -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_tokenizer():
    return load_tokenizer(ALIAS)


def test_regenerates_multi_turn_conversations(server, tmp_path, smol_tokenizer):
    conversations = [
        Conversation("two-turns", [user("What is 2+2?"), asst("orig 1"), user("And times 3?"), asst("orig 2")]),
        Conversation("system", [{"role": "system", "content": "Be brief."}, user("Capital of France?"), asst("x")]),
        Conversation("prompt-only", [user("Name a colour.")]),
    ]
    out = tmp_path / "r.jsonl"
    cfg = RegenConfig(max_new_tokens=12, max_turns=0)  # every turn
    report = rc.regenerate_via_server(conversations, out, cfg, server_cfg(server.url, concurrency=3),
                                      tokenizer=smol_tokenizer, tokenizer_name=ALIAS, progress=False)
    assert (report.written, report.turns, report.requests, report.failed) == (3, 4, 4, 0)
    records = {r["id"]: r for r in read_lines(out)}
    assert set(records) == {"two-turns", "system", "prompt-only"}
    rec = records["two-turns"]
    assert {k: rec[k] for k in ("regenerated_by", "server", "max_new_tokens", "temperature", "samples",
                                "chat_template_kwargs", "reasoning")} == {
        "regenerated_by": ALIAS, "server": server.url, "max_new_tokens": 12, "temperature": 0.0, "samples": 1,
        "chat_template_kwargs": None, "reasoning": "keep"}
    msgs = rec["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[1]["content"] != "orig 1" and msgs[3]["content"] != "orig 2"
    # Turn 2 answers a history holding the server's OWN first reply: asked again with exactly that
    # history (T=0; llama.cpp is deterministic here across batch compositions), it says the same.
    again = rc.regenerate_via_server([Conversation("check", msgs[:3])], tmp_path / "check.jsonl", cfg,
                                     server_cfg(server.url), progress=False)
    assert again.written == 1 and read_lines(tmp_path / "check.jsonl")[0]["messages"][3] == msgs[3]
    assert [m["role"] for m in records["system"]["messages"]] == ["system", "user", "assistant"]
    for r in records.values():  # one reply entry per assistant turn, re-tokenised with the target's tokenizer
        texts = [m["content"] for m in r["messages"] if m["role"] == "assistant"]
        assert len(r["replies"]) == len(texts)
        for reply, text in zip(r["replies"], texts, strict=True):
            assert reply["token_ids_from"] == f"tokenizer:{ALIAS}"
            assert reply["token_ids"] == smol_tokenizer.encode(text, add_special_tokens=False)
            assert reply["finish_reason"] in ("stop", "length") and 0 < reply["completion_tokens"] <= 12
    assert report.generated_tokens == sum(x["completion_tokens"] for r in records.values() for x in r["replies"])
    assert "4 requests" in report.summary()


def test_a_later_turn_whose_prompt_reaches_max_context_ends_the_conversation(server, tmp_path, smol_tokenizer):
    """As in-process: the first turn always runs; a later one whose prompt (counted by the target's
    tokenizer) reaches --max-context is not sent, and the record ends at the reply before it."""
    conv = Conversation("long", [user("What is 2+2?"), asst("o1"), user("And times 3?"), asst("o2")])
    first = len(smol_tokenizer.apply_chat_template(conv.messages[:1], add_generation_prompt=True, tokenize=True))
    cfg = RegenConfig(max_new_tokens=12, max_turns=0, max_context=first + 1)
    out = tmp_path / "r.jsonl"
    report = rc.regenerate_via_server([conv], out, cfg, server_cfg(server.url), tokenizer=smol_tokenizer,
                                      tokenizer_name=ALIAS, progress=False)
    assert (report.written, report.turns, report.requests, report.context_cut) == (1, 1, 1, 1)
    assert [m["role"] for m in read_lines(out)[0]["messages"]] == ["user", "assistant"]
    with pytest.raises(UsageError, match="^--max-context with --server needs --target"):
        rc.regenerate_via_server([conv], tmp_path / "r2.jsonl", cfg, server_cfg(server.url), progress=False)


def test_samples_and_settings_in_the_header(server, tmp_path):
    """--samples 2 writes q0#0, q0#1 (seeded per record and turn); other settings are refused."""
    out = tmp_path / "s.jsonl"
    cfg = RegenConfig(max_new_tokens=8, temperature=1.0, samples=2, seed=3)
    rc.regenerate_via_server(convs(1), out, cfg, server_cfg(server.url), progress=False)
    assert sorted(r["id"] for r in read_lines(out)) == ["q0#0", "q0#1"]
    with pytest.raises(UsageError, match=r"s\.jsonl:1: was regenerated with max_new_tokens 8 \(this run: 9\)"):
        rc.regenerate_via_server(convs(1), out, RegenConfig(max_new_tokens=9, temperature=1.0, samples=2, seed=3),
                                 server_cfg(server.url), progress=False)
    with pytest.raises(UsageError, match=r"chat_template_kwargs None \(this run: \{'enable_thinking': False\}\)"):
        rc.regenerate_via_server(convs(1), out, cfg, server_cfg(server.url,
                                                                chat_template_kwargs={"enable_thinking": False}),
                                 progress=False)
    again = rc.regenerate_via_server(convs(1), out, cfg, server_cfg(server.url), progress=False)
    assert (again.already_done, again.written, again.requests) == (2, 0, 0)


N_KILL = 10


def test_resume_after_kill_keeps_finished_conversations(server, tmp_path):
    source = write_source(tmp_path / "in.jsonl", convs(N_KILL))
    out = tmp_path / "out.jsonl"
    proc = start_cli(cli_args(server.url, source, out, "--max-new-tokens", "24", "--concurrency", "1"))
    try:
        wait_for_lines(out, 2, proc)
    finally:
        proc.kill()  # SIGKILL: no cleanup runs
        proc.communicate()
    before = out.read_bytes()
    kept = before.count(b"\n")
    assert 2 <= kept < N_KILL, "the kill should land mid-run"
    with open(out, "ab") as f:
        f.write(b'{"id": "q9", "messages": [{"role": "us')  # as if killed while writing a line
    cfg = RegenConfig(max_new_tokens=24, max_turns=0)  # the regenerate command's: every turn
    report = rc.regenerate_via_server(convs(N_KILL), out, cfg, server_cfg(server.url), progress=False)
    assert (report.already_done, report.written) == (kept, N_KILL - kept)
    assert out.read_bytes().startswith(before)  # finished lines untouched, the torn one gone
    ids = [r["id"] for r in read_lines(out)]
    assert sorted(ids) == [f"q{i}" for i in range(N_KILL)]


def test_server_stopped_mid_run_fails_cleanly_and_loses_nothing(tmp_path):
    """Bounded retries, the breaker, one line, exit 1; a rerun against the restarted server finishes."""
    srv = LlamaServer(parallel=1)
    source = write_source(tmp_path / "in.jsonl", convs(8))
    out = tmp_path / "out.jsonl"
    args = cli_args(srv.url, source, out, "--max-new-tokens", "24", "--concurrency", "2", "--retries", "2",
                    "--max-failures", "2")
    proc = start_cli(args)
    try:
        wait_for_lines(out, 1, proc)
        srv.kill()
        killed_at = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        srv.stop()
    assert time.monotonic() - killed_at < 45  # 2 retries, 0.5 s then 1 s of backoff: seconds, not minutes
    assert proc.returncode == 1, stderr
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr and len(lines) == 1, stderr
    assert lines[0].startswith(f"dflash-train: error: --server {srv.url}: 2 requests in a row failed "
                               "(each tried 3 times)")
    assert "rerun the same command to continue" in lines[0]
    written = read_lines(out)  # every line whole
    assert 1 <= len(written) < 8
    before = out.read_bytes()
    restarted = LlamaServer(port=srv.port)  # same URL: the header's server matches
    try:
        assert main(args) == 0
    finally:
        restarted.stop()
    assert out.read_bytes().startswith(before)
    assert sorted(r["id"] for r in read_lines(out)) == [f"q{i}" for i in range(8)]


# --- one-line usage errors ---------------------------------------------------------------------------

def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dflash-train: error: "), err
    return err.removeprefix("dflash-train: error: ")


def test_wrong_model_is_one_line_error(server, tmp_path, capsys):
    source = write_source(tmp_path / "in.jsonl", convs(1))
    out = tmp_path / "out.jsonl"
    err = _one_line_error(capsys, cli_args(server.url, source, out, "--model", "gpt-17"))
    assert err == f"--model gpt-17: not served by {server.url} (it serves: {ALIAS})"
    assert not out.exists() or out.read_bytes() == b""


def test_connection_errors_are_one_line(server, tmp_path, capsys, monkeypatch):
    source = write_source(tmp_path / "in.jsonl", convs(1))
    out = tmp_path / "out.jsonl"
    refused = f"http://127.0.0.1:{free_port()}"
    err = _one_line_error(capsys, cli_args(refused, source, out))
    assert err.startswith(f"--server {refused}: cannot connect (") and "refused" in err.lower()
    err = _one_line_error(capsys, cli_args("127.0.0.1:8000", source, out))
    assert err.startswith("--server must be an http:// or https:// URL")
    err = _one_line_error(capsys, cli_args(server.url + "/nothing/here", source, out))
    assert err.startswith(f"--server {server.url}/nothing/here: GET /v1/models answered HTTP 404")
    monkeypatch.setenv(KEY_ENV, "wrong-key")
    err = _one_line_error(capsys, cli_args(server.url, source, out))
    assert err == f"--api-key-env {KEY_ENV}: the server refused that key (HTTP 401)"
    err = _one_line_error(capsys, ["regenerate", "--server", server.url, "--data", str(source), "--out", str(out)])
    assert err == f"--server {server.url}: HTTP 401: the server wants an API key; give it with --api-key-env VAR"
    monkeypatch.delenv(KEY_ENV)
    err = _one_line_error(capsys, cli_args(server.url, source, out))
    assert err == f"--api-key-env {KEY_ENV}: the environment variable is not set"
    assert not out.exists() or out.read_bytes() == b""


# --- without a server: parsing and settings ------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(url="localhost:8000"), "--server must be an http"),
    (dict(url="http://h:1", concurrency=0), "--concurrency must be >= 1"),
    (dict(url="http://h:1", reasoning="hide"), "--reasoning must be keep or drop"),
    (dict(url="http://h:1", retries=-1), "--retries must be >= 0"),
    (dict(url="http://h:1", max_failures=0), "--max-failures must be >= 1"),
    (dict(url="http://h:1", request_timeout=0), "--request-timeout must be > 0"),
])
def test_server_config_errors_name_the_flag(kwargs, message):
    with pytest.raises(UsageError, match=f"^{message}"):
        rc.ServerConfig(**kwargs)


def test_server_url_is_normalised():
    assert rc.ServerConfig(url="http://h:8000/v1/").url == "http://h:8000"


@pytest.mark.parametrize("text, message", [("{nope", "not JSON"), ("[1]", "must be a JSON object")])
def test_template_kwargs_must_be_a_json_object(text, message):
    with pytest.raises(UsageError, match=f"^--chat-template-kwargs.*{message}"):
        rc.parse_template_kwargs(text)
    assert rc.parse_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}


@pytest.mark.parametrize("content, reasoning, mode, want", [
    ("The answer.", "Let me think.", "keep", "<think>\nLet me think.\n</think>\n\nThe answer."),
    ("The answer.", "Let me think.", "drop", "The answer."),
    ("<think>\nhmm\n</think>\n\nThe answer.", None, "keep", "<think>\nhmm\n</think>\n\nThe answer."),
    ("<think>\nhmm\n</think>\n\nThe answer.", None, "drop", "The answer."),
    ("<think>\nstill thinking when the limit hit", None, "drop", ""),
    ("No reasoning at all.", None, "drop", "No reasoning at all."),
])
def test_reasoning_keep_or_drop(content, reasoning, mode, want):
    text, had = rc._with_reasoning(content, reasoning, mode)
    assert text == want and had == (reasoning is not None or content.startswith("<think>"))


def test_server_token_ids_are_used_and_said_so(tmp_path):
    """A vLLM answer with return_token_ids: its ids are kept as the server's, not re-tokenised."""
    run = rc._Run([], tmp_path / "x.jsonl", RegenConfig(), rc.ServerConfig(url="http://h:1"),
                  tokenizer=None, tokenizer_name=None, progress=False)
    run.bar = _NoBar()
    answer = {"choices": [{"message": {"content": "Hi there"}, "finish_reason": "stop", "token_ids": [5, 6, 2]}],
              "usage": {"completion_tokens": 3}}
    reply = run._reply(answer)
    assert reply.text == "Hi there"
    assert reply.meta == {"finish_reason": "stop", "completion_tokens": 3, "token_ids": [5, 6, 2],
                          "token_ids_from": "server"}
    no_ids = run._reply({"choices": [{"message": {"content": "Hi"}, "finish_reason": "length"}]})
    assert no_ids.meta == {"finish_reason": "length", "completion_tokens": 0}
    assert (run.report.requests, run.report.hit_length_limit, run.report.generated_tokens) == (2, 1, 3)


class _NoBar:
    def set_postfix(self, **_kw):
        pass


def test_in_process_run_refuses_a_server_file(tmp_path):
    record = {"id": "a", "messages": [], "regenerated_by": ALIAS, "server": "http://h:1", "max_new_tokens": 8,
              "temperature": 0.0, "samples": 1}
    in_process = {"regenerated_by": ALIAS, "max_new_tokens": 8, "temperature": 0.0, "samples": 1}
    with pytest.raises(UsageError, match=r"was regenerated with server 'http://h:1' \(this run: None\)"):
        check_same_run(tmp_path / "f.jsonl", 1, record, in_process)
    del record["server"]
    check_same_run(tmp_path / "f.jsonl", 1, record, in_process)  # an in-process file still resumes


def test_server_flags_need_server(tmp_path, capsys):
    err = _one_line_error(capsys, ["regenerate", "--model", "m", "--out", str(tmp_path / "o.jsonl")])
    assert err == "--model needs --server (the in-process path runs --target itself)"


# --- train through the server ---------------------------------------------------------------------

def test_train_regenerates_through_the_server_and_trains_on_its_replies(server, tmp_path, monkeypatch):
    """`train --regen-server`: the server writes the replies the run prepares and trains on, with its
    URL in the cache key and in the regenerated file's header."""
    from dflash_train.cli import main

    monkeypatch.delenv("DFLASH_PROFILE_INTERVAL", raising=False)
    source = write_source(tmp_path / "in.jsonl", convs(6))
    run = tmp_path / "run"
    assert main(["train", "--target", "random:tiny", "--data", str(source), "--run-dir", str(run), "--device", "cpu",
                 "--regen-server", server.url, "--regen-api-key-env", KEY_ENV, "--regen-max-new-tokens", "12",
                 "--max-length", "96", "--token-budget", "192", "--num-anchors", "8", "--block-size", "4",
                 "--data-topic", "any", "--max-steps", "2", "--eval-limit", "0", "--quiet"]) == 0
    regenerated = read_lines(next(run.glob("regenerated-*.jsonl")))
    records = [r for r in regenerated if "id" in r]
    assert len(records) == 6 and all(r["messages"][-1]["content"] != "original" for r in records)
    assert any(server.url.rstrip("/") in json.dumps(r) for r in regenerated[:2])  # the header names the server
    assert next(run.glob("data-*/meta.json")).is_file() and (run / "drafter" / "config.json").is_file()


def test_train_names_its_own_flag_for_a_bad_server_url(tmp_path, capsys):
    from dflash_train.cli import main

    assert main(["train", "--target", "random:tiny", "--run-dir", str(tmp_path / "r"),
                 "--regen-server", "ftp://x"]) == 2
    assert "--regen-server must be an http:// or https:// URL" in capsys.readouterr().err
