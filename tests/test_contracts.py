"""The contracts between ``models/`` and ``distributed/`` (``ops/attention/contracts.py``, ``ops/routed_experts.py``)
answer ``isinstance`` from the class alone, as every Python from 3.11 does.

A ``@runtime_checkable`` Protocol with data members answered from the instance, and Python 3.12
changed how (``inspect.getattr_static``, blind to the submodules ``nn.Module`` keeps in
``_modules``): head stages then found no attention module on 3.12 and 3.13. These checks fail on
such a construct under any Python: an instance with no state at all (``object.__new__``, no
``__init__``, no ``_modules``) must still be recognised, and no contract may be a Protocol.
"""

import inspect

import pytest
import torch

from model_harness import small_args
from titan_ulysses.distributed.staged_attention import apply_head_stages
from titan_ulysses.models.compute import ComputeOptions
from titan_ulysses.models.decoder.attention import Attention
from titan_ulysses.models.moe.args import MoEArgs
from titan_ulysses.models.moe.experts import GroupedExperts
from titan_ulysses.ops.attention.contracts import HeadAttention
from titan_ulysses.ops.routed_experts import RoutedExperts

CONTRACTS = {HeadAttention: Attention, RoutedExperts: GroupedExperts}


@pytest.mark.parametrize("contract", list(CONTRACTS), ids=lambda c: c.__name__)
def test_isinstance_answers_from_the_class_alone(contract):
    implementation = CONTRACTS[contract]
    assert not getattr(contract, "_is_protocol", False), f"{contract.__name__} is a typing.Protocol"
    bare = object.__new__(implementation)  # no instance __dict__: nothing a member lookup could find
    assert "_modules" not in vars(bare)
    assert isinstance(bare, contract)
    assert not isinstance(object.__new__(torch.nn.Linear), contract)


def test_the_decoder_modules_are_recognised_with_their_submodules_kept_in_modules():
    """What a 3.12 member lookup sees (``inspect.getattr_static``) misses ``inner_attention``: the
    decoder's attention is staged all the same, because the answer comes from its class."""
    attention = Attention(small_args(), ComputeOptions())
    assert "inner_attention" in attention._modules and "inner_attention" not in vars(attention)
    with pytest.raises(AttributeError):
        inspect.getattr_static(attention, "inner_attention")
    assert isinstance(attention, HeadAttention)
    assert apply_head_stages(torch.nn.Sequential(attention), 2) == 1
    assert isinstance(GroupedExperts(8, MoEArgs(4, 2, 16)), RoutedExperts)


def test_a_model_without_the_contract_is_refused_in_one_line():
    """A module with the right methods but not the base class is not staged (no structural guess)."""

    class Lookalike(torch.nn.Module):
        head_dim, attention_kwargs = 8, {}

        def projections(self): ...

        def prepare_qk(self, q, k, rope): ...

    with pytest.raises(ValueError, match=r"^parallelism.ulysses_head_stages found no attention module.*= 1$"):
        apply_head_stages(torch.nn.Sequential(Lookalike()), 2)
