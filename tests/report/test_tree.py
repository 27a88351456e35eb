"""Terminal views: the ledger → block → tensor tree and the one-screen summary."""

from __future__ import annotations

import pytest

from trainmem.report.tree import ledger_groups, render_summary, render_tree
from trainmem.inventory import Category

from results import tiny_estimate


def test_tree_depths_and_exact_totals():
    e = tiny_estimate()
    # parameters: 32·8 embedding + 2 × (4·8·8 attention + 3·8·16 MLP + 2·8 norms) + 8 final norm
    # + 32·8 head = 1832 fp32 = 7328 B
    assert e.totals_bytes["parameter"] == 7328
    one = render_tree(e, depth=1).splitlines()
    assert one[1].split() == ["parameter", "7.16", "KiB", "Σ", "21", "tensors"]
    assert len(one) == 1 + 6 + 2  # headline, five ledgers and the model's buffers, sum and peak
    # the rotary inv_freq and original_inv_freq: hd/2 = 2 fp32 values each (estimate/buffers.py)
    assert one[6].split() == ["buffer", "16", "B", "Σ", "2", "tensors"]
    two = render_tree(e, depth=2)
    # 2 × (4·64 + 3·128 + 2·8) = 2 × 656 params = 2 × 2624 B
    assert "├─ blocks 0–1" in two and "2 × 2.56 KiB" in two
    three = render_tree(e)
    assert "self_attn.q_proj.weight" in three and "numel·4" in three
    assert "└─ … " in three  # compact: the smallest tensors of a group are summed up


def test_detail_lists_every_block_and_tensor():
    e = tiny_estimate()
    detail = render_tree(e, detail=True)
    assert "├─ block 0 " in detail and "block 1 " in detail and "… " not in detail
    tensor_lines = [l for l in detail.splitlines() if l.startswith(("│  ├─", "│  └─", "   ├─", "   └─"))]
    # every tensor once, blocks not folded
    assert len(tensor_lines) == len(e.inventory)
    with pytest.raises(ValueError, match="depth=0"):
        render_tree(e, depth=0)


def test_groups_fold_identical_blocks_only():
    e = tiny_estimate()
    acts = [i for i in e.inventory if i.category is Category.ACTIVATION]
    groups = ledger_groups(acts)
    assert [g.label for g in groups] == ["blocks 0–1", "outside blocks"]
    assert groups[0].count == 2 and sum(g.bytes_each * g.count for g in groups) == e.totals_bytes["activation"]
    assert [g.label for g in ledger_groups(acts, fold=False)] == ["block 0", "block 1", "outside blocks"]


def test_summary_fits_one_screen():
    e = tiny_estimate()
    text = render_summary(e)
    assert len(text.splitlines()) <= 30 and max(map(len, text.splitlines())) <= 120
    assert "← peak" in text and "█" in text
    assert [x for x in text.splitlines() if x.startswith("peak ")] == [  # the figure named, wrapped at 120 columns
        "peak 35.83 KiB allocated in phase 'optimizer' — optimizer.step(): foreach: sqrt(exp_avg_sq) of every tensor at "
        "once"]
