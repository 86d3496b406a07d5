"""Regeneration through a server keeps its secrets and says when nothing worked: the API key and a
URL's password never reach stderr or the records, and a run whose every request failed exits 1.

A small http.server stands in for the error paths llama.cpp will not produce on demand (tests/test_regen_server.py
talks to the real one): it serves one model, and answers chat completions with a reply or with an HTTP error whose
body echoes the request's headers, as some proxies do.
"""

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_train.app.run_dir import write_config
from dflash_train.cli import main
from dflash_train.data.regen_common import check_same_run
from dflash_train.settings.tree import TrainConfig

pytestmark = pytest.mark.slow  # starts an HTTP server

KEY_ENV, KEY = "DFLASH_TEST_SAFETY_KEY", "sk-secret-4242"
MODEL = "echo-model"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.server.seen.append(dict(self.headers))
        self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.seen.append(dict(self.headers))
        code = self.server.answer
        if code == 200:
            self._send(200, {"choices": [{"message": {"content": "a reply"}, "finish_reason": "stop"}],
                             "usage": {"completion_tokens": 2}})
        else:  # the request's headers, echoed back in the error message
            self._send(code, {"error": {"message": f"rejected request with headers {dict(self.headers)}"}})


@pytest.fixture
def echo_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.answer, srv.seen = 200, []
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def _source(tmp_path, n: int):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"hi {i}"}]}) + "\n"
                            for i in range(n)))
    return path


def _regenerate(url, tmp_path, n=3, *extra):
    return ["regenerate", "--server", url, "--data", str(_source(tmp_path, n)), "--out", str(tmp_path / "out.jsonl"),
            "--quiet", "--retries", "0", "--max-new-tokens", "4", *extra]


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip()


@pytest.mark.parametrize("status", [500, 400])
def test_a_run_whose_every_request_fails_exits_1_naming_the_count_and_first_error(echo_server, tmp_path, capsys,
                                                                                   status):
    echo_server.answer = status
    code, out, err = _run(_regenerate(echo_server.url, tmp_path, 3), capsys)
    assert code == 1, out + err
    assert len(err.splitlines()) == 1 and err.startswith(f"dflash-train: error: --server {echo_server.url}: ")
    assert "all 3 conversations" in err and f"the first with: HTTP {status}: rejected request" in err
    assert not (tmp_path / "out.jsonl").read_bytes()


def test_an_echoed_api_key_is_redacted(echo_server, tmp_path, capsys):
    echo_server.answer = 500  # the breaker's message quotes the last error
    code, out, err = _run(_regenerate(echo_server.url, tmp_path, 2, "--api-key-env", KEY_ENV, "--max-failures", "1"),
                          capsys)
    assert echo_server.seen[-1]["Authorization"] == f"Bearer {KEY}"  # the key was sent, and echoed
    assert code == 1 and "1 requests in a row failed" in err
    assert KEY not in out + err and "Bearer <redacted>" in err
    echo_server.answer = 400  # so does the message of a run whose every conversation failed
    code, out, err = _run(_regenerate(echo_server.url, tmp_path, 2, "--api-key-env", KEY_ENV), capsys)
    assert code == 1 and KEY not in out + err and "Bearer <redacted>" in err


def test_url_credentials_are_sent_but_never_written_or_printed(echo_server, tmp_path, capsys):
    host = echo_server.url.removeprefix("http://")
    secret_url = f"http://bob:hunter2pw@{host}"
    code, out, err = _run(_regenerate(secret_url, tmp_path, 2), capsys)
    assert code == 0, err
    basic = base64.b64encode(b"bob:hunter2pw").decode()
    assert all(h["Authorization"] == f"Basic {basic}" for h in echo_server.seen)  # still used for the requests
    text = (tmp_path / "out.jsonl").read_text()
    records = [json.loads(line) for line in text.splitlines()]
    assert len(records) == 2 and {r["server"] for r in records} == {echo_server.url}
    assert "hunter2pw" not in text and "hunter2pw" not in out + err

    # a rerun with the same URL continues that file; an error message shows the URL bare, an echo redacted
    code, out, err = _run(_regenerate(secret_url, tmp_path, 2, "--model", "other"), capsys)
    assert code == 2
    assert err == f"dflash-train: error: --model other: not served by {echo_server.url} (it serves: {MODEL})"
    echo_server.answer = 400
    (tmp_path / "out.jsonl").unlink()
    code, out, err = _run(_regenerate(secret_url, tmp_path, 1), capsys)
    assert code == 1 and "hunter2pw" not in err and basic not in err and "Basic <redacted>" in err


def test_the_run_config_keeps_the_server_url_without_its_credentials(tmp_path):
    cfg = TrainConfig.of(regen_server="http://bob:hunter2pw@127.0.0.1:9", regen_model=MODEL)
    write_config(tmp_path, cfg)
    text = (tmp_path / "config.toml").read_text()
    assert 'server = "http://127.0.0.1:9"' in text and "hunter2pw" not in text
    assert cfg.regeneration.server == "http://bob:hunter2pw@127.0.0.1:9"  # the run itself still uses them


def test_a_file_written_with_credentials_in_its_url_resumes(tmp_path):
    record = {"id": "a", "messages": [], "server": "http://bob:pw@h:1", "regenerated_by": MODEL}
    check_same_run(tmp_path / "f.jsonl", 1, record, {"server": "http://h:1", "regenerated_by": MODEL})
