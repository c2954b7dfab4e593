"""A SandboxFusion-compatible code-execution server over the project's sandbox.

``python -m hybridflow.sandbox serve --host H --port P`` answers ``POST /run_code`` in the shape of
ByteDance's SandboxFusion (:mod:`.api`), so verl's clients — ``SandboxFusionTool`` and the
``sandbox_fusion`` reward (``check_correctness``) — can point their ``sandbox_fusion_url`` at it
unchanged. Every request runs in a fresh sandbox of :mod:`hybridflow.utils.sandbox`
(its own filesystem, no network, no privileges, resource limits): a small driver program
(:mod:`._driver`) runs there, writes the request's files, compiles and runs the code with the
request's stdin and time/memory limits, and reports back (:mod:`.runner`). The languages a server runs
are those whose tools this machine has (:mod:`.languages`); others are refused by name.

Modules: :mod:`.api` (the wire shapes), :mod:`.languages` (how each language is built and run),
:mod:`.runner` (one request: limits, the driver, the response), :mod:`.app` (the FastAPI app),
:mod:`.__main__` (the command line). See docs/sandbox_fusion.md.
"""
