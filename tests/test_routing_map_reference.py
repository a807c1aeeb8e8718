"""The loop references of the routing-map family against examples worked by hand."""

from __future__ import annotations

import numpy as np

from tests.references import permute_grad_reference, permute_reference, unpermute_grad_reference, unpermute_reference

# --- the references against examples worked by hand -------------------------------------

ROUTING = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1]], np.int8)  # T = 4, E = 3, K = 2
TOKENS = np.arange(8, dtype=np.float32).reshape(4, 2)
PROBS = np.arange(12, dtype=np.float32).reshape(4, 3)


def test_permute_reference_not_padded_by_hand():
    permuted, sorted_indices, permuted_probs = permute_reference(TOKENS, ROUTING, PROBS, 8, 0)
    # expert 0 takes tokens 0, 2, 3; expert 1 takes 1, 2; expert 2 takes 0, 1, 3
    assert permuted[:, 0].tolist() == [0, 4, 6, 2, 4, 0, 2, 6]
    # token 0 -> rows 0 (expert 0), 5 (expert 2); token 1 -> 3, 6; token 2 -> 1, 4; token 3 -> 2, 7
    assert sorted_indices.tolist() == [0, 5, 3, 6, 1, 4, 2, 7]
    assert permuted_probs.tolist() == [0, 6, 9, 4, 7, 2, 5, 11]


def test_permute_reference_padded_by_hand():
    permuted, sorted_indices, permuted_probs = permute_reference(TOKENS, ROUTING, PROBS, 6, 1)
    # C = 2: expert 0 keeps 0, 2 (drops 3); expert 1 keeps 1, 2; expert 2 keeps 0, 1 (drops 3)
    assert sorted_indices.tolist() == [0, 2, 1, 2, 0, 1]
    assert permuted_probs.tolist() == [0, 6, 4, 7, 2, 5]
    # C = 4: expert 1 has two routed tokens, then fills with unrouted 0, 3
    _, filled, _ = permute_reference(TOKENS, ROUTING, PROBS, 12, 1)
    assert filled.tolist() == [0, 2, 3, 1, 1, 2, 0, 3, 0, 1, 3, 2]


def test_unpermute_reference_by_hand():
    permuted, sorted_indices, _ = permute_reference(TOKENS, ROUTING, PROBS, 8, 0)
    unpermuted, out_index, token_id, row_probs = unpermute_reference(permuted, sorted_indices, ROUTING, PROBS, 0, 4)
    assert token_id.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    # token 0: probs 0 (expert 0) and 2 (expert 2) times its row [0, 1]
    assert unpermuted[0].tolist() == [0, 2]
    assert unpermuted[1].tolist() == [(4 + 5) * 2, (4 + 5) * 3]


def test_grad_references_by_hand():
    grad = np.array([[1, 2]], np.float32)
    permuted = np.array([[3, 4], [5, 6]], np.float32)
    probs = np.array([[0.5, 0.25]], np.float32)
    routing = np.array([[1, 1]], np.int8)
    rows_grad, probs_grad = unpermute_grad_reference(
        grad, np.array([1, 0]), np.array([0, 0]), routing, permuted, probs, 0
    )
    assert rows_grad.tolist() == [[0.5, 1], [0.25, 0.5]]
    assert probs_grad.tolist() == [[11, 17]]
    tokens_grad, _ = permute_grad_reference(permuted, None, np.array([1, 0]), routing, 1, 2, 0)
    assert tokens_grad.tolist() == [[8, 10]]
