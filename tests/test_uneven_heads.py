"""Ulysses over head counts the degree does not divide: the split, the exchange and attention equal one process.

The model-level cases (every gradient and AdamW steps, 16 heads at sp=3 and a miniature of
Qwen2.5-7B's 28 heads with 4 kv heads at sp=8) are in ``test_model_parallel.py``'s CASES.
"""

import itertools

import pytest

from dist_utils import run_distributed
from helpers import attention_matches
from titan_ulysses.distributed.heads import (
    attended_heads,
    check_heads,
    exchanged_kv_heads,
    head_plan,
    is_even,
    uneven_note,
)


def test_qwen25_7b_at_sp8_gives_every_rank_one_kv_head():
    plan = head_plan(28, 4, 8)
    assert plan.q_counts == [4, 3, 4, 3, 4, 3, 4, 3]
    assert plan.kv_counts == [1] * 8 and [a for a, _ in plan.kv] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(plan.kv_index(r) is None for r in range(8))  # plain GQA groups: nothing to expand
    assert exchanged_kv_heads(28, 4, 8) == 8 and exchanged_kv_heads(32, 4, 8) == 8  # each kv head to two ranks
    assert attended_heads(28, 4, 8) == (4, 1, 1)


def test_straddling_q_heads_take_one_kv_head_each():
    plan = head_plan(16, 4, 3)
    assert plan.q == ((0, 6), (6, 11), (11, 16)) and plan.kv == ((0, 2), (1, 3), (2, 4))
    assert plan.kv_index(0) == [0, 0, 0, 0, 1, 1]  # 4 + 2 q heads on two kv heads: not one GQA group size
    assert plan.kv_index(1) == [0, 0, 1, 1, 1]
    assert attended_heads(16, 4, 3) == (6, 2, 6)  # 2 kv heads received, expanded to 6
    # 6 heads on 2 kv heads over 3 ranks: rank 1's two q heads use one kv head each, as plain MHA
    assert all(head_plan(6, 2, 3).kv_index(r) is None for r in range(3))


@pytest.mark.parametrize("n_heads,n_kv_heads", [(16, 4), (28, 4), (24, 6), (40, 8), (6, 1), (12, 12), (14, 2)])
def test_every_plan_covers_each_q_head_once_with_the_kv_heads_it_uses(n_heads, n_kv_heads):
    group = n_heads // n_kv_heads
    for sp in range(2, n_heads + 1):
        if is_even(n_heads, n_kv_heads, sp):
            continue
        plan = head_plan(n_heads, n_kv_heads, sp)
        heads = list(itertools.chain.from_iterable(range(a, b) for a, b in plan.q))
        assert heads == list(range(n_heads)), (sp, plan)
        assert max(plan.q_counts) - min(plan.q_counts) <= 1 and min(plan.q_counts) >= 1, (sp, plan)
        for (a, b), (ka, kb) in zip(plan.q, plan.kv):
            assert {h // group for h in range(a, b)} == set(range(ka, kb)), (sp, plan)  # what it needs, no more


def test_refusals_name_the_limit_and_the_cp_splits():
    check_heads(16, 4, sp=3, tp=1)  # uneven: allowed
    check_heads(28, 4, sp=8, tp=1)
    check_heads(24, 6, sp=4, tp=1)
    with pytest.raises(ValueError, match=r"^ulysses_degree 8 is larger than the 6 attention heads per tensor-parallel "
                                         r"rank .*; to split each sequence over 8 ranks, use ulysses_degree x "
                                         r"context_parallel_degree = 2 x 4, 1 x 8$"):
        check_heads(6, 1, sp=8, tp=1)
    with pytest.raises(ValueError, match=r"^ulysses_degree 8 is larger than the 4 attention heads per "
                                         r"tensor-parallel rank \(n_heads 8 / tensor_parallel_degree 2\)"):
        check_heads(8, 2, sp=8, tp=2)
    with pytest.raises(ValueError, match=r"^n_kv_heads 4 is not divisible by tensor_parallel_degree 8; "
                                         r"tensor_parallel_degree can be one of \[1, 2, 4\]"):
        check_heads(32, 4, sp=1, tp=8)
    note = uneven_note(28, 4, 8, 1)
    assert "q heads per rank [4, 3, 4, 3, 4, 3, 4, 3]" in note and "ulysses_degree 4 x context_parallel_degree 2" in note
    assert uneven_note(32, 8, 8, 1) is None


def _many(sp, cases):
    for n_heads, n_kv_heads, seq_len, backend, docs, backward in cases:
        attention_matches(sp, n_heads, n_kv_heads, seq_len, backend, docs, backward)


def test_uneven_attention_matches_single_process_sp3():
    run_distributed(_many, 3, 3, [
        (16, 4, 13, "sdpa", False, True),  # q heads 6/5/5 straddling kv groups: local expansion
        (6, 2, 13, "sdpa", False, True),  # kv heads 2 over 3 ranks: each kv head to two ranks, grads summed
        (7, 7, 14, "sdpa", True, True),  # MHA 3/2/2 with a document mask
        (16, 4, 14, "flex", True, False),  # flex (forward: no CPU backward in torch 2.13)
        (10, 2, 13, "sdpa", True, True),  # kv groups of 5 over ranks of 4/3/3 q heads, with documents
    ])
