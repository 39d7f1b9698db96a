"""Scheduler unit tests with a real BlockAllocator and hand-made Requests (no model).

Page size 4 throughout, so a request with n tokens holds ceil(n / 4) pages.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine.cache.allocator import BlockAllocator, OutOfBlocksError
from engine.config import EngineConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import SampleResult, Scheduler

EOS = 2
PS = 4


def make_scheduler(
    num_pages: int = 16,
    budget: int = 64,
    max_num_seqs: int = 8,
    num_slots: int | None = None,
    max_model_len: int = 64,
) -> Scheduler:
    cfg = EngineConfig(model="unused", page_size=PS, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)
    pages = BlockAllocator("kv pages", num_pages)
    slots = BlockAllocator("kda slots", num_slots) if num_slots is not None else None
    return Scheduler(cfg, max_model_len, (EOS,), pages, slots)


def req(rid: str, n_prompt: int, max_tokens: int = 16, **kw) -> Request:
    kw.setdefault("ignore_eos", True)
    return Request(
        rid,
        list(range(10, 10 + n_prompt)),
        SamplingParams(max_tokens=max_tokens, temperature=0, **kw),
    )


def chunks(out) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def step(s: Scheduler, token: int = 7):
    """schedule + postprocess, every sampling request draws `token`."""
    out = s.schedule()
    sampled = {c.request.request_id: SampleResult([token], []) for c in out.chunks if c.samples}
    return out, s.postprocess(out, sampled)


# ---- allocation --------------------------------------------------------------------------------
def test_exact_page_ids_and_growth():
    s = make_scheduler(num_pages=10)
    a, b = req("a", 6), req("b", 9)
    s.add(a)
    s.add(b)
    out, updated = step(s)
    assert chunks(out) == [("a", 0, 6), ("b", 0, 9)]
    assert a.page_ids == [0, 1] and b.page_ids == [2, 3, 4]
    assert updated == [a, b] and a.output_token_ids == [7] and b.output_token_ids == [7]
    assert a.num_computed_tokens == 6 and b.num_computed_tokens == 9
    assert [r.status for r in (a, b)] == [RequestStatus.RUNNING] * 2
    # decode: a has 7 tokens (2 pages), b has 10 (3 pages): nothing new yet
    out, _ = step(s)
    assert chunks(out) == [("a", 6, 1), ("b", 9, 1)]
    assert a.page_ids == [0, 1] and b.page_ids == [2, 3, 4]
    out, _ = step(s)  # indices 7 and 10: still inside the held pages
    assert chunks(out) == [("a", 7, 1), ("b", 10, 1)]
    assert a.page_ids == [0, 1] and b.page_ids == [2, 3, 4]
    out, _ = step(s)  # a writes index 8: a 3rd page; b writes index 11: still 3 pages
    assert chunks(out) == [("a", 8, 1), ("b", 11, 1)]
    assert a.page_ids == [0, 1, 5] and b.page_ids == [2, 3, 4]
    out, _ = step(s)  # b writes index 12: a 4th page
    assert chunks(out) == [("a", 9, 1), ("b", 12, 1)]
    assert a.page_ids == [0, 1, 5] and b.page_ids == [2, 3, 4, 6]
    assert s.pages.num_used == 7


def test_page_boundary_exact_fit():
    s = make_scheduler(num_pages=2)
    r = req("r", 8)
    s.add(r)
    out, _ = step(s)
    assert chunks(out) == [("r", 0, 8)] and r.page_ids == [0, 1]
    assert s.pages.num_free == 0


# ---- token budget ------------------------------------------------------------------------------
def test_budget_running_first_then_waiting():
    s = make_scheduler(budget=8)
    a, b, c = req("a", 3), req("b", 20), req("c", 5)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert chunks(out) == [("a", 0, 3), ("b", 0, 5)]  # c: no budget left
    assert [ch.samples for ch in out.chunks] == [True, False]  # b's prompt is not done yet
    assert s.postprocess(out, {"a": SampleResult([7], [])}) == [a] and b.output_token_ids == []
    assert list(s.waiting) == [c]
    out, _ = step(s)
    assert chunks(out) == [("a", 3, 1), ("b", 5, 7)]  # decode first, prefill takes the rest
    out, _ = step(s)
    assert chunks(out) == [("a", 4, 1), ("b", 12, 7)]
    out, updated = step(s)
    assert chunks(out) == [("a", 5, 1), ("b", 19, 1), ("c", 0, 5)]  # b's last prompt token samples
    assert updated == [a, b, c]
    assert b.output_token_ids == [7] and c.output_token_ids == [7]
    out, _ = step(s)
    assert chunks(out) == [("a", 6, 1), ("b", 20, 1), ("c", 5, 1)]


def test_waiting_prompt_is_chunked_by_leftover_budget():
    s = make_scheduler(budget=5)
    a, b = req("a", 2), req("b", 11)
    s.add(a)
    s.add(b)
    out, _ = step(s)
    assert chunks(out) == [("a", 0, 2), ("b", 0, 3)]
    assert b.page_ids == [1]  # only the pages for the tokens scheduled so far
    out, _ = step(s)
    assert chunks(out) == [("a", 2, 1), ("b", 3, 4)]
    assert b.page_ids == [1, 2]


def test_max_num_seqs():
    s = make_scheduler(max_num_seqs=2)
    rs = [req("a", 3, max_tokens=2), req("b", 3, max_tokens=5), req("c", 3, max_tokens=5)]
    for r in rs:
        s.add(r)
    out, _ = step(s)
    assert chunks(out) == [("a", 0, 3), ("b", 0, 3)]
    assert [r.request_id for r in s.running] == ["a", "b"] and list(s.waiting) == [rs[2]]
    out, _ = step(s)  # a reaches max_tokens=2 and finishes: c may only start next step
    assert chunks(out) == [("a", 3, 1), ("b", 3, 1)]
    assert rs[0].finish_reason == "length" and rs[0].page_ids == []
    out, _ = step(s)
    assert chunks(out) == [("b", 4, 1), ("c", 0, 3)]
    assert len(s.running) == 2


def test_no_slot_no_admission():
    s = make_scheduler(num_slots=2, max_num_seqs=8)
    rs = [req(x, 3) for x in "abc"]
    for r in rs:
        s.add(r)
    out, _ = step(s)
    assert chunks(out) == [("a", 0, 3), ("b", 0, 3)]
    assert [r.slot_ids for r in rs] == [[0], [1], []]
    s.abort("a")
    assert s.slots.num_free == 1
    out, _ = step(s)
    assert chunks(out) == [("b", 3, 1), ("c", 0, 3)]
    assert rs[2].slot_ids == [0]


# ---- not enough pages --------------------------------------------------------------------------
def test_request_needing_more_pages_than_free_waits():
    s = make_scheduler(num_pages=4)
    a, c = req("a", 10), req("c", 8)
    s.add(a)
    step(s)
    assert a.page_ids == [0, 1, 2]
    s.add(c)  # needs 2 pages, 1 free
    out, _ = step(s)
    assert chunks(out) == [("a", 10, 1)]
    assert list(s.waiting) == [c] and c.page_ids == [] and c.status is RequestStatus.WAITING
    assert s.num_preemptions == 0  # waiting requests never preempt running ones
    s.abort("a")
    assert s.pages.num_free == 4
    out, _ = step(s)
    assert chunks(out) == [("c", 0, 8)]
    assert c.page_ids == [3, 0]  # free list order: 3 was never used, then a's pages in order


def test_small_first_chunk_fits_where_whole_prompt_does_not():
    s = make_scheduler(num_pages=4, budget=5)
    a, c = req("a", 10), req("c", 8)
    s.add(a)
    out, _ = step(s)
    assert chunks(out) == [("a", 0, 5)] and a.page_ids == [0, 1]
    out, _ = step(s)
    assert chunks(out) == [("a", 5, 5)] and a.page_ids == [0, 1, 2] and a.output_token_ids == [7]
    s.add(c)
    out, _ = step(s)
    assert chunks(out) == [("a", 10, 1), ("c", 0, 4)]  # c's first 4 tokens need just page 3
    assert c.page_ids == [3]


# ---- preemption --------------------------------------------------------------------------------
def _two_full_requests(num_slots: int | None = None):
    s = make_scheduler(num_pages=4, num_slots=num_slots)
    a, b = req("a", 7), req("b", 7)
    s.add(a)
    s.add(b)
    step(s)  # 8 tokens each
    step(s)  # decode token index 7: still 2 pages each; now 9 tokens each
    assert a.page_ids == [0, 1] and b.page_ids == [2, 3] and s.pages.num_free == 0
    return s, a, b


def test_preemption_picks_youngest_and_frees_its_pages():
    s, a, b = _two_full_requests()
    out = s.schedule()  # a needs a 3rd page: b (youngest) goes
    assert out.preempted == [b]
    assert chunks(out) == [("a", 8, 1)]
    assert a.page_ids == [0, 1, 2]  # b's first page, reused at once
    assert b.page_ids == [] and b.num_computed_tokens == 0 and b.status is RequestStatus.WAITING
    assert b.output_token_ids == [7, 7]  # kept: recomputed, not regenerated
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert list(s.waiting) == [b] and s.running == [a]
    assert s.pages.num_free == 1 and s.pages.ref_count(3) == 0
    s.postprocess(out, {"a": SampleResult([7], [])})
    # b must recompute all 9 tokens (3 pages); only 1 is free: it waits
    out, _ = step(s)
    assert chunks(out) == [("a", 9, 1)] and not out.preempted


def test_preempted_request_resumes_with_full_recompute():
    s, a, b = _two_full_requests()
    step(s)  # preempts b
    assert a.page_ids == [0, 1, 2]
    s.abort("a")
    out, updated = step(s, token=8)
    assert chunks(out) == [("b", 0, 9)]  # prompt + the 2 tokens it had generated
    assert updated == [b] and b.output_token_ids == [7, 7, 8]
    assert b.page_ids == [3, 0, 1] and b.num_computed_tokens == 9


def test_youngest_of_three_is_preempted():
    s = make_scheduler(num_pages=6)
    a, b, c = req("a", 7), req("b", 7), req("c", 7)
    for r in (a, b, c):
        s.add(r)
    step(s)
    step(s)
    assert [r.page_ids for r in (a, b, c)] == [[0, 1], [2, 3], [4, 5]]
    out = s.schedule()  # a and b each need a 3rd page: c's two pages cover both
    assert out.preempted == [c]
    assert chunks(out) == [("a", 8, 1), ("b", 8, 1)]
    assert a.page_ids == [0, 1, 4] and b.page_ids == [2, 3, 5] and c.page_ids == []
    assert s.running == [a, b] and list(s.waiting) == [c]


def test_preempting_itself_when_youngest():
    s = make_scheduler(num_pages=4)
    a, b = req("a", 6), req("b", 7)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    assert a.page_ids == [0, 1] and b.page_ids == [2, 3]
    out = s.schedule()  # a writes index 7 (fits); b, the youngest, needs a 3rd page
    assert out.preempted == [b] and chunks(out) == [("a", 7, 1)]
    assert b.page_ids == [] and b.num_computed_tokens == 0 and s.running == [a]
    assert list(s.waiting) == [b] and s.pages.num_free == 2 and a.page_ids == [0, 1]


def test_preemption_frees_slots():
    s, a, b = _two_full_requests(num_slots=2)
    assert a.slot_ids == [0] and b.slot_ids == [1]
    out = s.schedule()
    assert out.preempted == [b] and b.slot_ids == [] and s.slots.num_free == 1


def test_no_admission_in_a_step_that_preempted():
    s, a, b = _two_full_requests()
    c = req("c", 1)
    s.add(c)
    out = s.schedule()
    assert out.preempted == [b] and chunks(out) == [("a", 8, 1)] and a.page_ids == [0, 1, 2]
    assert list(s.waiting) == [b, c]  # the preempted request goes first in line


def test_preempted_request_not_readmitted_in_the_same_step():
    s, a, b = _two_full_requests()
    # a small budget: b's first recompute chunk (1 token, 1 page) would fit right after preemption
    s.config = dataclasses.replace(s.config, max_num_batched_tokens=2)
    out = s.schedule()
    assert out.preempted == [b] and chunks(out) == [("a", 8, 1)]
    assert list(s.waiting) == [b] and b.page_ids == [] and a.page_ids == [0, 1, 2]
    s.postprocess(out, {"a": SampleResult([7], [])})
    out = s.schedule()
    assert chunks(out) == [("a", 9, 1), ("b", 0, 1)] and b.page_ids == [3]


# ---- finishing and abort -----------------------------------------------------------------------
def test_stop_reasons_and_release():
    s = make_scheduler(num_pages=8, max_model_len=12)
    e = req("eos", 3, ignore_eos=False)
    i = req("ign", 3, ignore_eos=True)
    st = req("stop", 3, stop_token_ids=(9,))
    n = req("len", 3, max_tokens=2)
    m = req("mml", 10, max_tokens=50)
    for r in (e, i, st, n, m):
        s.add(r)
    out = s.schedule()
    s.postprocess(
        out,
        {
            "eos": SampleResult([EOS], []),
            "ign": SampleResult([EOS], []),
            "stop": SampleResult([9], []),
            "len": SampleResult([5], []),
            "mml": SampleResult([5], []),
        },
    )
    assert (e.finish_reason, i.finish_reason, st.finish_reason, n.finish_reason) == (
        "stop",
        None,
        "stop",
        None,
    )
    assert e.output_token_ids == [EOS] and st.output_token_ids == [9]
    assert e.page_ids == [] and st.page_ids == [] and i.page_ids == [1]
    out = s.schedule()
    s.postprocess(out, {"ign": SampleResult([EOS], []), "len": SampleResult([5], []), "mml": SampleResult([5], [])})
    assert n.finish_reason == "length" and n.output_token_ids == [5, 5]
    assert m.finish_reason == "length" and m.num_tokens == 12  # max_model_len
    assert i.finish_reason is None and s.running == [i]
    assert s.pages.num_used == 1


def test_abort_running_and_waiting():
    s = make_scheduler(num_pages=8, budget=9)
    a, b, c = req("a", 5), req("b", 4), req("c", 6)
    for r in (a, b, c):
        s.add(r)
    step(s)
    assert a.page_ids == [0, 1] and b.page_ids == [2] and list(s.waiting) == [c]
    assert s.abort("a") is a
    assert a.finish_reason == "abort" and a.status is RequestStatus.FINISHED and a.page_ids == []
    assert s.pages.num_free == 7 and s.pages.ref_count(0) == 0 and s.pages.ref_count(1) == 0
    assert s.abort("c") is c and not s.waiting and c.finish_reason == "abort"
    assert s.abort("zzz") is None
    out, _ = step(s)
    assert chunks(out) == [("b", 4, 1)] and b.page_ids == [2, 3]
    # the freed pages come back in order after the never-used ones
    assert s.pages.allocate(6) == [4, 5, 6, 7, 0, 1]


def test_abort_while_step_runs_is_not_postprocessed():
    s = make_scheduler()
    a, b = req("a", 4), req("b", 4)
    s.add(a)
    s.add(b)
    out = s.schedule()
    s.abort("a")  # e.g. the client went away while the model ran
    updated = s.postprocess(out, {"a": SampleResult([7], []), "b": SampleResult([7], [])})
    assert updated == [b]
    assert a.output_token_ids == [] and a.num_computed_tokens == 0 and a.page_ids == []
    assert s.has_unfinished() and s.running == [b]


# ---- the allocator itself ----------------------------------------------------------------------
def test_block_allocator():
    al = BlockAllocator("kv pages", 3)
    assert al.allocate(2) == [0, 1] and al.num_used == 2
    with pytest.raises(OutOfBlocksError, match="kv pages: asked for 2, 1 free of 3"):
        al.allocate(2)
    al.share([1])
    al.free([1])
    assert al.ref_count(1) == 1 and al.num_free == 1
    al.free([1, 0])
    assert al.num_free == 3 and al.allocate(3) == [2, 1, 0]
    al.free([0])
    with pytest.raises(ValueError, match="double free of block 0"):
        al.free([0])
    with pytest.raises(ValueError, match="cannot share free block 0"):
        al.share([0])
