"""``python -m hybridflow.retrieval serve`` over HTTP: BM25 ranks the passage that answers first, ``topk``
is honoured, Search-R1's response shape, and bad requests answered 4xx while the server keeps serving."""

import json
import socket

import httpx
import pytest

from hybridflow.retrieval.__main__ import main
from hybridflow.retrieval.corpus import CorpusError, read_corpus

from .conftest import LIMITS


def post(url, body, **kwargs):
    if isinstance(body, (dict, list)):
        return httpx.post(url, json=body, timeout=10, **kwargs)
    return httpx.post(url, content=body, timeout=10, **kwargs)


def test_the_passage_that_answers_ranks_first(retrieval_server):
    url, _ = retrieval_server
    queries = ["who created the python programming language", "highest mountain on earth", "zebra stripes"]
    answer = post(url, {"queries": queries, "topk": 3, "return_scores": True})
    assert answer.status_code == 200
    result = answer.json()["result"]
    assert [hits[0]["document"]["id"] for hits in result] == ["python", "everest", "zebra"]
    for hits in result:
        scores = [hit["score"] for hit in hits]
        assert scores == sorted(scores, reverse=True) and scores[0] > 0
    # Search-R1's document fields; a title/text corpus line is served as "Title\ntext"
    zebra = result[2][0]["document"]
    assert zebra == {
        "id": "zebra",
        "title": "Zebra",
        "text": "Zebras are African equines with black and white stripes.",
        "contents": "Zebra\nZebras are African equines with black and white stripes.",
    }


def test_topk_is_honoured(retrieval_server):
    url, _ = retrieval_server
    query = "capital city of France, capital of Germany, highest mountain, Nobel Prizes"  # hits 4 passages
    for topk, expected in ((1, 1), (2, 2), (5, 4)):  # only passages sharing a word are returned
        result = post(url, {"queries": [query], "topk": topk, "return_scores": True}).json()["result"]
        assert len(result[0]) == expected
    # no topk: the server's default (3, Search-R1's); no return_scores: plain documents, as Search-R1
    result = post(url, {"queries": [query, "qwxyzzy"]}).json()["result"]
    assert len(result[0]) == 3 and "contents" in result[0][0] and "score" not in result[0][0]
    assert result[1] == []  # no known word: nothing, rather than zero-score passages
    assert post(url, {"queries": []}).json() == {"result": []}


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"not json", 400, "not JSON"),
        (b"\xff\xfe\x00", 400, "not JSON"),
        ([1, 2], 422, "JSON object"),
        ({"topk": 1}, 422, "'queries'"),
        ({"queries": "paris"}, 422, "'queries'"),
        ({"queries": ["paris", 3]}, 422, "'queries'"),
        ({"queries": ["q"] * (LIMITS["max_queries"] + 1)}, 422, "at most 4"),
        ({"queries": ["paris"], "topk": 0}, 422, "'topk'"),
        ({"queries": ["paris"], "topk": LIMITS["topk_max"] + 1}, 422, "from 1 to 5"),
        ({"queries": ["paris"], "topk": "3"}, 422, "'topk'"),
        ({"queries": ["paris"], "topk": True}, 422, "'topk'"),
        ({"queries": ["paris"], "topk": 2.5}, 422, "'topk'"),
        ({"queries": ["paris"], "return_scores": "yes"}, 422, "'return_scores'"),
        ({"queries": ["x" * LIMITS["max_request_bytes"]]}, 413, "over 4096 bytes"),
    ],
)
def test_bad_requests_get_a_4xx_json_answer(retrieval_server, body, status, says):
    url, process = retrieval_server
    answer = post(url, body)
    assert answer.status_code == status and says in answer.json()["detail"]
    assert process.poll() is None


def test_the_server_survives_hostile_requests(retrieval_server):
    url, process = retrieval_server

    def chunks():  # no content-length: the limit is applied as the body streams in
        for _ in range(100):
            yield b'{"queries": ["' + b"a" * 100

    assert post(url, chunks()).status_code == 413
    assert httpx.get(url, timeout=5).status_code == 405
    port = int(url.split(":")[2].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:  # a body cut short, then gone
        raw.sendall(b'POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"queries": ["pa')
    answer = post(url, {"queries": ["capital of France"], "topk": 1})
    assert answer.status_code == 200 and answer.json()["result"][0][0]["id"] == "paris"
    health = httpx.get(url.replace("/retrieve", "/health"), timeout=5).json()
    assert health == {"status": "ok", "documents": 6, "topk_max": 5, "max_queries": 4}
    assert process.poll() is None


def test_a_bad_corpus_is_refused_naming_the_line(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"contents": "A\ntext"}), "", json.dumps({"id": 2, "body": "x"})]
    corpus.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError, match=r"corpus.jsonl:3: needs a string 'contents'"):
        read_corpus(corpus)
    corpus.write_text('{"contents": "A\\ntext"}\n[1]\n')
    with pytest.raises(CorpusError, match=r"corpus.jsonl:2: expected a JSON object"):
        read_corpus(corpus)
    corpus.write_text('{"title": "A", "text": "t"}\n')
    assert read_corpus(corpus)[0].contents == "A\nt" and read_corpus(corpus)[0].id == "0"
    corpus.write_text("\n")
    for bad, says in ((corpus, "no documents"), (tmp_path / "missing.jsonl", "not found")):
        with pytest.raises(SystemExit, match=says):
            main(["serve", "--corpus", str(bad)])
    corpus.write_text('{"contents": "the of\\nand"}\n')
    with pytest.raises(SystemExit, match="no document of the corpus has a word"):
        main(["serve", "--corpus", str(corpus)])
