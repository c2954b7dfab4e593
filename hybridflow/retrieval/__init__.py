"""A Search-R1-compatible retrieval server over a user's corpus (BM25).

``python -m hybridflow.retrieval serve --corpus FILE.jsonl --host H --port P`` answers
``POST /retrieve`` in the shape of Search-R1's retrieval server (the one verl's Search-R1 example starts,
``examples/sglang_multiturn/search_r1_like/local_dense_retriever/retrieval_server.py``), so verl's
``SearchTool`` can point its ``retrieval_service_url`` at ``http://H:P/retrieve`` unchanged. The corpus is
Search-R1's jsonl (``{"id": ..., "contents": "Title\\ntext"}`` a line, or ``title`` and ``text`` fields);
it is ranked with Okapi BM25 (Robertson and Zaragoza 2009) from ``bm25s``: Search-R1's sparse retriever
is BM25 too, through pyserini, which needs a Java these machines lack. Dense retrieval is not offered.

Modules: :mod:`.corpus` (reading the corpus, the BM25 index), :mod:`.app` (the FastAPI app, request
checks), :mod:`.__main__` (the command line). See docs/agent_loops.md, section "Search".
"""
