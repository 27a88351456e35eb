"""``trainmem serve``: an interactive page on a local server. Pick a model, a GPU and a count,
move the controls, and see the estimate's phase chart, ledgers, verdict, the largest micro-batch
and sequence that fit, and the advisor's fixes (docs/serve.md)."""

from trainmem.serve.server import make_server

__all__ = ["make_server"]
