"""Shared by the hostile-input tests (a plain module: ``conftest`` names clash across folders)."""

from __future__ import annotations

from dataclasses import dataclass

TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


@dataclass
class Run:
    rc: int | str
    out: str
    err: str

    @property
    def lines(self) -> list[str]:
        return self.err.strip().splitlines()


def assert_one_line_error(r: Run) -> None:
    assert r.rc == 2, (r.rc, r.err[-500:])
    assert "Traceback" not in r.err and "internal error" not in r.err, r.err[-500:]
    assert len(r.lines) == 1, r.err[-1000:]
