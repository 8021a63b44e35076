"""How attention heads are split over the ranks of a Ulysses group: arithmetic, no process groups.

Ulysses gives each of the P ranks of the sp group a share of the (tensor-parallel-local)
heads for the whole sequence. Three cases:

* **even** (``Hq % P == 0`` and the kv heads divide P or are divided by it): every rank
  gets ``Hq/P`` q heads; kv heads either split evenly or, when fewer than P, are repeated
  so that each rank receives the one its q heads use. One equal-block all-to-all.
* **uneven** (anything else with ``P <= Hq``): rank r gets a contiguous range of q heads,
  sizes differing by at most one, and receives *every* kv head its q heads use, so a kv
  head may travel to two ranks (its gradient is summed back by the all-to-all's
  backward). When P is a multiple of the kv head count, each kv group's q heads are split
  over ``P / Hkv`` ranks, so every rank needs exactly one kv head (Qwen2.5-7B's 28 heads
  with 4 kv heads at P=8: 4,3,4,3,... q heads and one kv head each); otherwise the q heads
  are split in order and a rank whose q heads do not map evenly onto its kv heads expands
  its kv heads locally to one per q head before attending.
* **refused**: more ranks than heads, or heads that tensor parallelism cannot split. The
  message names the ``ulysses_degree x context_parallel_degree`` splits that keep the
  sequence over as many ranks: context parallelism does not split heads.

The busiest rank of an uneven split attends ``ceil(Hq/P)`` heads, so attention runs as
fast as at the largest even degree below P while everything else is split P ways.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _balanced(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` sizes that differ by at most one, larger first."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def is_even(n_heads: int, n_kv_heads: int, sp: int) -> bool:
    """Whether every rank gets ``n_heads / sp`` q heads and the kv heads split or replicate evenly."""
    return n_heads % sp == 0 and (n_kv_heads % sp == 0 or sp % n_kv_heads == 0)


def kv_replication_factor(n_heads: int, n_kv_heads: int, sp: int) -> int:
    """How many times each kv head is repeated before an even exchange (1 = none).

    ``n_heads`` and ``n_kv_heads`` are the counts seen by one tensor-parallel rank.
    """
    if not is_even(n_heads, n_kv_heads, sp):
        raise ValueError(f"{n_heads} heads with {n_kv_heads} kv heads do not split evenly over ulysses_degree {sp}; "
                         f"see head_plan for the uneven split")
    return 1 if n_kv_heads % sp == 0 else sp // n_kv_heads


@dataclass(frozen=True)
class HeadPlan:
    """Which heads each rank of the sp group attends (ranges are [start, end) of the local heads)."""

    q: tuple[tuple[int, int], ...]
    """Per rank, its contiguous range of q heads; in rank order they cover all q heads."""
    kv: tuple[tuple[int, int], ...]
    """Per rank, the contiguous range of kv heads its q heads use (ranges of two ranks may overlap)."""
    group: int
    """q heads per kv head (GQA group size)."""

    @property
    def q_counts(self) -> list[int]:
        return [b - a for a, b in self.q]

    @property
    def kv_counts(self) -> list[int]:
        return [b - a for a, b in self.kv]

    def kv_index(self, rank: int) -> list[int] | None:
        """For each local q head of ``rank``, the index of its kv head among the rank's received kv heads,
        or None when the local heads already form even GQA groups (the local attention takes them as they are)."""
        (a, b), (ka, kb) = self.q[rank], self.kv[rank]
        index = [h // self.group - ka for h in range(a, b)]
        n_q, n_kv = b - a, kb - ka
        if n_q % n_kv == 0 and index == [i // (n_q // n_kv) for i in range(n_q)]:
            return None
        return index

    def busiest(self) -> tuple[int, int, int]:
        """(q heads, kv heads received, kv heads attended) of the rank with the most q heads: what memory and time
        follow. kv heads are attended as received unless the rank expands them to one per q head (``kv_index``)."""
        worst = max(range(len(self.q)), key=lambda r: self.q_counts[r])
        n_q, n_kv = self.q_counts[worst], self.kv_counts[worst]
        return n_q, n_kv, (n_q if self.kv_index(worst) is not None else n_kv)

    def kv_sent(self) -> int:
        """kv heads the group sends in all (a kv head that two ranks use counts twice): the exchange's kv volume."""
        return sum(self.kv_counts)


@functools.lru_cache(maxsize=None)
def head_plan(n_heads: int, n_kv_heads: int, sp: int) -> HeadPlan:
    """The uneven split of ``n_heads`` q heads (``n_kv_heads`` kv heads) over ``sp`` ranks (cached: every layer of
    every step asks for the same one)."""
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
    if sp > n_heads:
        raise ValueError(f"ulysses_degree {sp} is larger than the {n_heads} heads to split")
    group = n_heads // n_kv_heads
    if sp % n_kv_heads == 0 and sp // n_kv_heads <= group:  # each kv group's q heads over sp/Hkv ranks
        sizes = [s for _ in range(n_kv_heads) for s in _balanced(group, sp // n_kv_heads)]
    else:
        sizes = _balanced(n_heads, sp)
    starts = [sum(sizes[:r]) for r in range(sp)]
    q = tuple((a, a + n) for a, n in zip(starts, sizes))
    kv = tuple((a // group, (b - 1) // group + 1) for a, b in q)
    return HeadPlan(q=q, kv=kv, group=group)


def attended_heads(n_heads: int, n_kv_heads: int, sp: int) -> tuple[int, int, int]:
    """(q heads, kv heads received, kv heads attended) of the busiest rank, over the whole sequence, for estimates.

    Even splits: ``Hq/P`` and the kv heads after replication; uneven: see ``HeadPlan.busiest``.
    """
    if is_even(n_heads, n_kv_heads, sp):
        kv = n_kv_heads * kv_replication_factor(n_heads, n_kv_heads, sp) // sp
        return n_heads // sp, kv, kv
    return head_plan(n_heads, n_kv_heads, sp).busiest()


def exchanged_kv_heads(n_heads: int, n_kv_heads: int, sp: int) -> int:
    """kv heads the all-to-all carries for the whole group: after replication (even) or to every rank that uses them."""
    if is_even(n_heads, n_kv_heads, sp):
        return n_kv_heads * kv_replication_factor(n_heads, n_kv_heads, sp)
    return head_plan(n_heads, n_kv_heads, sp).kv_sent()


def check_heads(n_heads: int, n_kv_heads: int, sp: int, tp: int, cp: int = 1) -> None:
    """Refuse head/degree combinations that cannot be laid out, naming the degrees that work.

    Tensor parallelism needs the q and kv heads to divide by its degree; Ulysses takes any
    degree up to the heads per tensor-parallel rank (unevenly where it must, see the module
    docstring). Besides the degrees that work, the message names the splits
    ``ulysses_degree x context_parallel_degree`` that keep the sequence over as many ranks
    (``sp x cp``). Pure arithmetic: call it before any process group exists.
    """

    def works(s: int, t: int) -> bool:
        return n_heads % t == 0 and n_kv_heads % t == 0 and s <= n_heads // t

    if works(sp, tp):
        return
    good_tp = [t for t in _divisors(n_heads) if works(sp, t)]
    if n_heads % tp or n_kv_heads % tp:
        what = "n_heads" if n_heads % tp else "n_kv_heads"
        count = n_heads if n_heads % tp else n_kv_heads
        reason = f"{what} {count} is not divisible by tensor_parallel_degree {tp}"
        hint = f"tensor_parallel_degree can be one of {good_tp}" if good_tp else "lower tensor_parallel_degree"
        raise ValueError(f"{reason}; {hint}")
    local = n_heads // tp
    reason = (f"ulysses_degree {sp} is larger than the {local} attention heads per tensor-parallel rank "
              f"(n_heads {n_heads} / tensor_parallel_degree {tp}): Ulysses gives every rank at least one head")
    hint = f"with tensor_parallel_degree {tp}, ulysses_degree can be at most {local}"
    ranks = sp * cp  # ranks per sequence; the splits of it that the heads allow, most Ulysses first
    splits = [(s, ranks // s) for s in reversed(_divisors(ranks)) if works(s, tp) and s < ranks]
    even = [(s, c) for s, c in splits if is_even(local, n_kv_heads // tp, s)]
    if splits:
        hint += (f"; to split each sequence over {ranks} ranks, use ulysses_degree x context_parallel_degree = "
                 + ", ".join(f"{s} x {c}" for s, c in (even or splits)))
    raise ValueError(f"{reason}; {hint}")


def uneven_note(n_heads: int, n_kv_heads: int, sp: int, tp: int) -> str | None:
    """A line for the start-up log when Ulysses splits the heads unevenly, else None."""
    hq, hkv = n_heads // tp, n_kv_heads // tp
    if sp == 1 or is_even(hq, hkv, sp):
        return None
    plan = head_plan(hq, hkv, sp)
    evens = [s for s in _divisors(sp) if is_even(hq, hkv, s)]
    best = max(evens)
    return (f"ulysses_degree {sp} splits {hq} heads ({hkv} kv heads) per tensor-parallel rank unevenly: "
            f"q heads per rank {plan.q_counts}, kv heads {plan.kv_counts}; attention takes as long as the "
            f"busiest rank's {max(plan.q_counts)} heads (an even share would be {hq / sp:.3g}). "
            f"An even split over as many ranks: ulysses_degree {best} x context_parallel_degree {sp // best}")
