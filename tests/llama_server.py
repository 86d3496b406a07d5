"""Serve a GGUF with llama.cpp's own OpenAI-compatible server until SIGTERM / SIGINT.

    python tests/llama_server.py MODEL.gguf [--alias NAME] [--parallel N] [--threads N] [--ctx N] \
        [--port N] [--api-key KEY]

The server is llama.cpp's C++ server (continuous batching, /v1/chat/completions), from the
prebuilt PyPI wheel `xllamacpp` (scripts/install.sh test). It listens on a free port of
127.0.0.1 and prints one line, `listening http://127.0.0.1:PORT`, once it is ready.
Used by tests/test_regen_server.py and by the measurement in docs/training.md.
"""

import argparse
import signal
import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--alias", default=None)
    ap.add_argument("--parallel", type=int, default=4, help="slots: requests decoded together")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096, help="context shared by all slots")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--api-key", default=None, help="require this bearer token")
    args = ap.parse_args()

    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = args.model
    if args.alias:
        p.model_alias = {args.alias}  # a set of names in this llama.cpp
    p.hostnames = ["127.0.0.1"]
    p.port = args.port or free_port()
    p.n_ctx = args.ctx
    p.n_parallel = args.parallel
    p.cpuparams.n_threads = args.threads
    p.cpuparams_batch.n_threads = args.threads
    p.warmup = False
    if args.api_key:
        p.api_keys = [args.api_key]
    server = xlc.Server(p)  # loads the model and starts listening in a background thread
    print(f"listening {server.listening_address}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    return 0


if __name__ == "__main__":
    sys.exit(main())
