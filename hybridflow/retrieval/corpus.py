"""The corpus a retrieval server ranks, and its BM25 index.

A corpus file is Search-R1's jsonl: one JSON object a line, ``{"id": "0", "contents": "Title\\ntext"}``
(the first line of ``contents`` is the title, as verl's ``SearchTool`` reads it back), or with ``title`` and
``text`` fields instead of ``contents``. A line without an ``id`` gets its 0-based line number among the
documents. Blank lines are skipped; anything else that is not such an object stops the load with the file
and line named.

Ranking is Okapi BM25 (``bm25s``'s default Lucene variant, k1=1.5, b=0.75) over ``contents`` (title and
text), lower-cased, English stop words dropped, no stemming: the same query ranks the same way on every
install. Only documents that share a word with the query are returned (score > 0), so a query with no
known word gets an empty list, as Search-R1's pyserini BM25 answers it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

STOPWORDS = "en"  # bm25s's English stop-word list


class CorpusError(ValueError):
    """A corpus file that cannot be served; the message names the file and line."""


@dataclass(frozen=True)
class Document:
    """One passage: ``contents`` is ``"Title\\ntext"`` (Search-R1's field)."""

    id: str
    contents: str

    def as_dict(self) -> dict[str, str]:
        """The document as the server returns it: Search-R1's fields, the title without its quotes (the
        wiki-18 corpus writes titles as ``"Title"``; ``contents`` is kept verbatim)."""
        title, _, text = self.contents.partition("\n")
        return {"id": self.id, "title": title.strip('"'), "text": text, "contents": self.contents}


def read_corpus(path: str | Path) -> list[Document]:
    """The documents of the jsonl file at ``path`` (module docstring), in file order."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    documents: list[Document] = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if line.strip():
                documents.append(_document(line, len(documents), f"{path}:{line_number}"))
    if not documents:
        raise CorpusError(f"{path}: the corpus has no documents")
    return documents


def _document(line: str, index: int, where: str) -> Document:
    try:
        record = json.loads(line)
    except ValueError as error:
        raise CorpusError(f"{where}: not a JSON object: {error}") from None
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(record).__name__}")
    contents = record.get("contents")
    if contents is None and ("title" in record or "text" in record):
        contents = f"{record.get('title') or ''}\n{record.get('text') or ''}"
    if not isinstance(contents, str):
        raise CorpusError(f"{where}: needs a string 'contents' (\"Title\\ntext\"), or 'title' and 'text'")
    doc_id = record.get("id", index)
    return Document(id=str(doc_id), contents=contents)


class BM25Index:
    """BM25 over ``documents`` (module docstring); :meth:`search` may be called from many threads."""

    def __init__(self, documents: list[Document]) -> None:
        import bm25s

        self.documents = documents
        tokens = bm25s.tokenize([doc.contents for doc in documents], stopwords=STOPWORDS, show_progress=False)
        if not tokens.vocab:
            raise CorpusError("no document of the corpus has a word to index (only stop words or empty)")
        self._retriever = bm25s.BM25()
        self._retriever.index(tokens, show_progress=False)
        self._lock = threading.Lock()  # bm25s does not promise thread safety; a search takes milliseconds

    def search(self, queries: list[str], k: int) -> list[list[tuple[Document, float]]]:
        """For each query, up to ``k`` ``(document, score)`` pairs, best first."""
        import bm25s

        k = min(k, len(self.documents))
        if not queries or k < 1:
            return [[] for _ in queries]
        tokens = bm25s.tokenize(queries, stopwords=STOPWORDS, show_progress=False, return_ids=False)
        with self._lock:
            ids, scores = self._retriever.retrieve(tokens, k=k, show_progress=False)
        return [
            [(self.documents[int(i)], float(s)) for i, s in zip(row_ids, row_scores) if s > 0]
            for row_ids, row_scores in zip(ids, scores)
        ]
