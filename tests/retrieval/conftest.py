"""The retrieval server as its own process (``python -m hybridflow.retrieval serve`` over a six-passage
corpus, on a free port of 127.0.0.1, with small limits), and a small server that answers junk."""

import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from hybridflow.utils.ports import find_free_port as free_port

CORPUS = [
    {"id": "paris", "contents": "Paris\nParis is the capital and largest city of France."},
    {"id": "berlin", "contents": "Berlin\nBerlin is the capital of Germany, on the river Spree."},
    {"id": "everest", "contents": "Mount Everest\nMount Everest is Earth's highest mountain above sea level"},
    {"id": "python", "contents": "Python (programming language)\nPython was created by Guido van Rossum."},
    {"id": "zebra", "title": "Zebra", "text": "Zebras are African equines with black and white stripes."},
    {"id": "curie", "contents": "Marie Curie\nMarie Curie won Nobel Prizes in physics and in chemistry."},
]
LIMITS = {"topk_max": 5, "max_queries": 4, "max_request_bytes": 4096}


@pytest.fixture(scope="session")
def retrieval_server(tmp_path_factory):
    """``(retrieve_url, process)`` of a healthy server."""
    folder = tmp_path_factory.mktemp("retrieval")
    corpus = folder / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in CORPUS))
    port, log = free_port(), folder / "server.log"
    command = [sys.executable, "-m", "hybridflow.retrieval", "serve", "--corpus", str(corpus)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--topk-max", str(LIMITS["topk_max"])]
    command += ["--max-queries", str(LIMITS["max_queries"])]
    command += ["--max-request-bytes", str(LIMITS["max_request_bytes"])]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the retrieval server exited: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the retrieval server did not become healthy: {log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield f"{url}/retrieve", process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


JUNK = {  # path -> (status, body)
    "/junk": (200, b"<html>not json</html>"),
    "/list": (200, b"[1, 2]"),
    "/empty": (200, b"{}"),
    "/no_results": (200, b'{"result": []}'),
    "/baddoc": (200, b'{"result": [[{"score": 1.0}]]}'),
    "/error": (500, b"boom"),
}


class _JunkHandler(http.server.BaseHTTPRequestHandler):
    """Answers each path of ``JUNK``; ``/slow`` answers after 3 s; counts the requests per path."""

    hits: dict = {}

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        _JunkHandler.hits[self.path] = _JunkHandler.hits.get(self.path, 0) + 1
        if self.path == "/slow":
            time.sleep(3)
        status, body = JUNK.get(self.path, (200, b'{"result": [[]]}'))
        with contextlib.suppress(OSError):  # /slow's client has given up by now
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def junk_server():
    """``(base_url, hits)``: hits counts the requests each path got."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _JunkHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _JunkHandler.hits
    server.shutdown()
    server.server_close()
